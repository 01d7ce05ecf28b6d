"""Conformance: ``examples/custom_diffusion/train_custom_diffusion.py``'s training step.

Custom Diffusion trains new key / value projections *inside* the frozen UNet: the script
replaces every attention processor with ``CustomDiffusionAttnProcessor2_0`` (a module that
holds ``to_k_custom_diffusion`` / ``to_v_custom_diffusion``, initialised from the UNet's own
``to_k`` / ``to_v``; trainable in the cross-attention layers only, ``--freeze_model
crossattn_kv``; also ``to_q`` / ``to_out`` with ``crossattn``). With ``--modifier_token`` it
also trains the CLIP token embedding, as textual inversion does. The loss is masked by the
dataset's valid-region mask at latent resolution, and with prior preservation the instance
half is masked while the class half is not.

So: without a modifier token, the frozen text encoder's states and the VAE's moments are
cached, the UNet (with its trainable processors) runs in stage 2; with one, the text encoder
must stay whole in stage 2 (its first op reads the trainable embedding), and only the VAE is
cached. The script zeroes the embedding's gradient rows but the new tokens' after
``backward``; that edits gradients this file compares before it, identically on both sides.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
from diffusers.models.attention_processor import (  # noqa: E402
    CustomDiffusionAttnProcessor,
    CustomDiffusionAttnProcessor2_0,
)

from tests.conformance.unseen2_checks import assert_trains_from_its_cache  # noqa: E402
from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
    word_tokenizer,
)
from tests.zoo import SD_SIZES  # noqa: E402

INSTANCE_PROMPT = "photo of a <new1> cat"
CLASS_PROMPT = "photo of a cat"


def freeze_params(params):
    """The script's, verbatim."""
    for param in params:
        param.requires_grad = False


def collate_fn(examples, with_prior_preservation):
    """The script's, verbatim."""
    input_ids = [example["instance_prompt_ids"] for example in examples]
    pixel_values = [example["instance_images"] for example in examples]
    mask = [example["mask"] for example in examples]
    # Concat class and instance examples for prior preservation.
    # We do this to avoid doing two forward passes.
    if with_prior_preservation:
        input_ids += [example["class_prompt_ids"] for example in examples]
        pixel_values += [example["class_images"] for example in examples]
        mask += [example["class_mask"] for example in examples]

    input_ids = torch.cat(input_ids, dim=0)
    pixel_values = torch.stack(pixel_values)
    mask = torch.stack(mask)
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    mask = mask.to(memory_format=torch.contiguous_format).float()

    batch = {"input_ids": input_ids, "pixel_values": pixel_values, "mask": mask.unsqueeze(1)}
    return batch


def build(*, modifier_token: str | None, freeze_model: str = "crossattn_kv", prior: bool = False):
    """``main()``'s setup, as the script writes it, on the zoo's tiny SD-1.5 configs."""
    torch.manual_seed(0)
    spec = SD_SIZES["tiny"]
    tokenizer = word_tokenizer(["photo", "of", "a", "cat"])
    tokenizer.model_max_length = 16
    text_encoder = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            eos_token_id=2,
        )
    )
    vae = diffusers.AutoencoderKL(sample_size=spec.resolution, **spec.vae)
    unet = diffusers.UNet2DConditionModel(**spec.unet)
    noise_scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear"
    )
    args = types.SimpleNamespace(
        modifier_token=modifier_token,
        initializer_token="cat",
        freeze_model=freeze_model,
        with_prior_preservation=prior,
        prior_loss_weight=1.0,
    )
    modifier_token_id = []
    initializer_token_id = []
    if args.modifier_token is not None:
        args.modifier_token = args.modifier_token.split("+")
        args.initializer_token = args.initializer_token.split("+")
        for modifier_token, initializer_token in zip(
            args.modifier_token, args.initializer_token[: len(args.modifier_token)]
        ):
            # Add the placeholder token in tokenizer
            num_added_tokens = tokenizer.add_tokens(modifier_token)
            assert num_added_tokens == 1
            # Convert the initializer_token, placeholder_token to ids
            token_ids = tokenizer.encode([initializer_token], add_special_tokens=False)
            initializer_token_id.append(token_ids[0])
            modifier_token_id.append(tokenizer.convert_tokens_to_ids(modifier_token))
        # Resize the token embeddings as we are adding new special tokens to the tokenizer
        text_encoder.resize_token_embeddings(len(tokenizer))
        # Initialise the newly added placeholder token with the embeddings of the initializer
        token_embeds = text_encoder.get_input_embeddings().weight.data
        for x, y in zip(modifier_token_id, initializer_token_id):
            token_embeds[x] = token_embeds[y]
        # Freeze all parameters except for the token embeddings in text encoder
        text_module = (
            text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
        )
        params_to_freeze = itertools.chain(
            text_module.encoder.parameters(),
            text_module.final_layer_norm.parameters(),
            text_module.embeddings.position_embedding.parameters(),
        )
        freeze_params(params_to_freeze)

    vae.requires_grad_(False)
    if args.modifier_token is None:
        text_encoder.requires_grad_(False)
    unet.requires_grad_(False)
    weight_dtype = torch.float32
    attention_class = (
        CustomDiffusionAttnProcessor2_0
        if hasattr(F, "scaled_dot_product_attention")
        else CustomDiffusionAttnProcessor
    )
    # Only train key, value projection layers if freeze_model = 'crossattn_kv' else train all
    # params in the cross attention layer
    train_kv = True
    train_q_out = False if args.freeze_model == "crossattn_kv" else True  # noqa: SIM211
    custom_diffusion_attn_procs = {}

    st = unet.state_dict()
    for name, _ in unet.attn_processors.items():
        cross_attention_dim = (
            None if name.endswith("attn1.processor") else unet.config.cross_attention_dim
        )
        if name.startswith("mid_block"):
            hidden_size = unet.config.block_out_channels[-1]
        elif name.startswith("up_blocks"):
            block_id = int(name[len("up_blocks.")])
            hidden_size = list(reversed(unet.config.block_out_channels))[block_id]
        elif name.startswith("down_blocks"):
            block_id = int(name[len("down_blocks.")])
            hidden_size = unet.config.block_out_channels[block_id]
        layer_name = name.split(".processor")[0]
        weights = {
            "to_k_custom_diffusion.weight": st[layer_name + ".to_k.weight"],
            "to_v_custom_diffusion.weight": st[layer_name + ".to_v.weight"],
        }
        if train_q_out:
            weights["to_q_custom_diffusion.weight"] = st[layer_name + ".to_q.weight"]
            weights["to_out_custom_diffusion.0.weight"] = st[layer_name + ".to_out.0.weight"]
            weights["to_out_custom_diffusion.0.bias"] = st[layer_name + ".to_out.0.bias"]
        if cross_attention_dim is not None:
            custom_diffusion_attn_procs[name] = attention_class(
                train_kv=train_kv,
                train_q_out=train_q_out,
                hidden_size=hidden_size,
                cross_attention_dim=cross_attention_dim,
            ).to(unet.device)
            custom_diffusion_attn_procs[name].load_state_dict(weights)
        else:
            custom_diffusion_attn_procs[name] = attention_class(
                train_kv=False,
                train_q_out=False,
                hidden_size=hidden_size,
                cross_attention_dim=cross_attention_dim,
            )
    del st
    unet.set_attn_processor(custom_diffusion_attn_procs)
    with torch.no_grad():  # as after some steps: the new k/v no longer equal the UNet's
        for processor in custom_diffusion_attn_procs.values():
            for param in processor.parameters():
                param.add_(torch.randn_like(param) * 0.02)
    vae.eval()  # as from_pretrained returns it
    unet.train()
    if args.modifier_token is not None:
        text_encoder.train()
    else:
        text_encoder.eval()

    def training_step(batch):
        # Convert images to latent space
        latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
        latents = latents * vae.config.scaling_factor

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()

        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        # Get the text embedding for conditioning
        encoder_hidden_states = text_encoder(batch["input_ids"])[0]

        # Predict the noise residual
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        if args.with_prior_preservation:
            # Chunk the noise and model_pred into two parts and compute the loss on each part
            # separately.
            model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
            target, target_prior = torch.chunk(target, 2, dim=0)
            mask = torch.chunk(batch["mask"], 2, dim=0)[0]
            # Compute instance loss
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = ((loss * mask).sum([1, 2, 3]) / mask.sum([1, 2, 3])).mean()

            # Compute prior loss
            prior_loss = F.mse_loss(
                model_pred_prior.float(), target_prior.float(), reduction="mean"
            )

            # Add the prior loss to the instance loss.
            loss = loss + args.prior_loss_weight * prior_loss
        else:
            mask = batch["mask"]
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = ((loss * mask).sum([1, 2, 3]) / mask.sum([1, 2, 3])).mean()
        return loss

    trainable = [p for p in (*unet.parameters(), *text_encoder.parameters()) if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step, tokenizer=tokenizer, unet=unet, trainable=trainable
    )


def _ids(tokenizer, prompt: str) -> torch.Tensor:
    return tokenizer(
        prompt,
        truncation=True,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        return_tensors="pt",
    ).input_ids


def _example(parts, index: int, resolution: int = 32) -> dict:
    """``CustomDiffusionDataset.__getitem__``: the image, the valid-region mask at latent size
    (a random rescale leaves a border), ``(1, L)`` ids, and the class example."""
    generator = torch.Generator().manual_seed(700 + index)
    latent = resolution // 2
    mask = torch.zeros(latent, latent)
    border = index % 3
    mask[border : latent - border, border : latent - border] = 1
    return {
        "instance_images": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
        "mask": mask,
        "instance_prompt_ids": _ids(parts.tokenizer, INSTANCE_PROMPT),
        "class_images": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
        "class_mask": torch.ones_like(mask),
        "class_prompt_ids": _ids(parts.tokenizer, CLASS_PROMPT),
    }


def _batch(parts, indices, prior: bool = False) -> dict:
    return collate_fn([_example(parts, i) for i in indices], prior)


def _trainable_processors(unet) -> int:
    return sum(
        any(p.requires_grad for p in processor.parameters())
        for processor in unet.attn_processors.values()
    )


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("freeze_model", ["crossattn_kv", "crossattn"])
def test_frozen_text_encoder_is_cached_and_the_processors_train(size, freeze_model):
    parts = build(modifier_token=None, freeze_model=freeze_model)
    assert _trainable_processors(parts.unet) == 4  # the tiny UNet's cross-attentions
    split = split_and_verify(parts.step, (_batch(parts, range(size)),))
    assert stage2_top_modules(split) == {"unet"}
    # The VAE's moments, CLIP's last hidden state (``text_encoder(...)[0]``) and the mask.
    assert set(split.boundary) == {"vae_encode_latent_dist_parameters", "text_encoder_0", "mask"}
    assert split.boundary["text_encoder_0"].shape[1:] == (16, 32)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert {n for n, p in parts.unet.named_parameters(prefix="unet") if p.requires_grad} <= held


@pytest.mark.parametrize("size", [1, 2, 3])
def test_modifier_token_keeps_the_text_encoder_in_stage2(size):
    parts = build(modifier_token="<new1>")
    split = split_and_verify(parts.step, (_batch(parts, range(size)),))
    assert stage2_top_modules(split) == {"text_encoder", "unet"}
    cached = {key for key in split.boundary if key not in split.input_names}
    assert cached == {"vae_encode_latent_dist_parameters", "view", "position_embeddings"}


@pytest.mark.parametrize("modifier_token", [None, "<new1>"])
def test_prior_preservation_masks_the_instance_half(modifier_token):
    parts = build(modifier_token=modifier_token, prior=True)
    split_and_verify(parts.step, (_batch(parts, [0, 1], prior=True),))


def test_modifier_token_trains_from_its_cache_after_every_trainable_weight_moves(tmp_path):
    parts = build(modifier_token="<new1>")
    split = graphsplit.split(parts.step, (_batch(parts, [0, 1]),))
    batches = [_batch(parts, [2, 3]), _batch(parts, [4])]
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, parts.trainable)


def test_frozen_text_encoder_cache_round_trip(tmp_path):
    parts = build(modifier_token=None)
    split = graphsplit.split(parts.step, (_batch(parts, [0, 1]),))
    batches = [_batch(parts, [2 * k, 2 * k + 1]) for k in range(3)]
    assert_cache_round_trip(split, parts.step, batches, tmp_path, parts.unet, rows_per_batch=2)
