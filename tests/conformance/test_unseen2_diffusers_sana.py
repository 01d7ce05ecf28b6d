"""Conformance: ``examples/dreambooth/train_dreambooth_lora_sana.py``'s training step.

Sana conditions on a Gemma-2 text encoder through a ``SanaPipeline`` built without VAE and
transformer (``text_encoding_pipeline.encode_prompt``: padded ids, an *attention mask* the
transformer's cross-attention reads), encodes pixels with the deep-compression
``AutoencoderDC`` (``vae.encode(...).latent``: deterministic, no distribution), moves the VAE
to the device *inside* the loop body (``vae = vae.to(accelerator.device)``, and back with
``--offload``), and trains LoRA on ``to_k`` / ``to_q`` / ``to_v`` of the
``SanaTransformer2DModel`` with flow matching, logit-normal timesteps and the script's
``get_sigmas`` (a ``.nonzero().item()`` per drawn timestep: the module-level path).
Configs are diffusers' tiny Sana test configs. Two ways to condition, both tested:
``--instance_prompt`` alone (embeddings and mask encoded once before the loop, the text
encoder deleted; one image a batch, as the embeddings' batch of one fixes) and a caption per
image (``compute_text_embeddings`` in the step, the pipeline moved with ``.to`` there too).
Stage 1 must hold the VAE and the transformer's frozen work on the prompt embeddings.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    word_tokenizer,
)

WORDS = ["a", "photo", "of", "sks", "dog", "on", "the", "beach", "in", "snow", "red"]
CAPTIONS = ["a photo of sks dog on the beach", "a sks dog in snow", "a red sks dog"]


def collate_fn(examples, with_prior_preservation=False):
    """The script's, verbatim."""
    pixel_values = [example["instance_images"] for example in examples]
    prompts = [example["instance_prompt"] for example in examples]

    # Concat class and instance examples for prior preservation.
    # We do this to avoid doing two forward passes.
    if with_prior_preservation:
        pixel_values += [example["class_images"] for example in examples]
        prompts += [example["class_prompt"] for example in examples]

    pixel_values = torch.stack(pixel_values)
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

    batch = {"pixel_values": pixel_values, "prompts": prompts}
    return batch


def build(*, custom_instance_prompts: bool, offload: bool = False):
    """``main()``'s models and the loop body, as closures over its locals."""
    torch.manual_seed(0)
    tokenizer = word_tokenizer(WORDS)
    text_encoder = transformers.Gemma2Model(
        transformers.Gemma2Config(
            head_dim=16,
            hidden_size=8,
            initializer_range=0.02,
            intermediate_size=64,
            max_position_embeddings=8192,
            num_attention_heads=2,
            num_hidden_layers=1,
            num_key_value_heads=2,
            vocab_size=len(tokenizer),
            attn_implementation="eager",
        )
    )
    vae = diffusers.AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=[1, 1],
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    transformer = diffusers.SanaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=8,
    )
    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    args = types.SimpleNamespace(
        instance_prompt="a photo of sks dog",
        max_sequence_length=12,
        complex_human_instruction=None,
        offload=offload,
        weighting_scheme="logit_normal",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        with_prior_preservation=False,
        prior_loss_weight=1.0,
        rank=4,
        lora_alpha=4,
        lora_dropout=0.0,
        cache_latents=False,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    weight_dtype = torch.float32
    transformer.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    for model in (transformer, vae, text_encoder):
        model.eval()  # as from_pretrained returns them
    text_encoding_pipeline = diffusers.SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=None,
        transformer=None,
        scheduler=noise_scheduler,
    )
    target_modules = ["to_k", "to_q", "to_v"]
    # now we will add new LoRA weights the transformer layers
    transformer_lora_config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=target_modules,
    )
    transformer.add_adapter(transformer_lora_config)
    with torch.no_grad():  # as after some steps: lora_B starts at zero
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)

    def compute_text_embeddings(prompt, text_encoding_pipeline):
        text_encoding_pipeline = text_encoding_pipeline.to(accelerator.device)
        with torch.no_grad():
            prompt_embeds, prompt_attention_mask, _, _ = text_encoding_pipeline.encode_prompt(
                prompt,
                max_sequence_length=args.max_sequence_length,
                complex_human_instruction=args.complex_human_instruction,
            )
        if args.offload:
            text_encoding_pipeline = text_encoding_pipeline.to("cpu")
        prompt_embeds = prompt_embeds.to(transformer.dtype)
        return prompt_embeds, prompt_attention_mask

    prompt_embeds = prompt_attention_mask = None
    if not custom_instance_prompts:
        instance_prompt_hidden_states, instance_prompt_attention_mask = compute_text_embeddings(
            args.instance_prompt, text_encoding_pipeline
        )
        # Clear the memory here
        del text_encoder, tokenizer
        prompt_embeds = instance_prompt_hidden_states
        prompt_attention_mask = instance_prompt_attention_mask
    vae_config_scaling_factor = vae.config.scaling_factor

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(accelerator.device)
        timesteps = timesteps.to(accelerator.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    transformer.train()

    def training_step(batch):
        nonlocal prompt_embeds, prompt_attention_mask, vae
        prompts = batch["prompts"]

        # encode batch prompts when custom prompts are provided for each image -
        if custom_instance_prompts:
            prompt_embeds, prompt_attention_mask = compute_text_embeddings(
                prompts, text_encoding_pipeline
            )

        # Convert images to latent space
        vae = vae.to(accelerator.device)
        pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
        model_input = vae.encode(pixel_values).latent
        if args.offload:
            vae = vae.to("cpu")
        model_input = model_input * vae_config_scaling_factor
        model_input = model_input.to(dtype=weight_dtype)

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]

        # Sample a random timestep for each image
        # for weighting schemes where we sample timesteps non-uniformly
        u = compute_density_for_timestep_sampling(
            weighting_scheme=args.weighting_scheme,
            batch_size=bsz,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
        )
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)

        # Add noise according to flow matching.
        # zt = (1 - texp) * x + texp * z1
        sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise

        # Predict the noise residual
        model_pred = transformer(
            hidden_states=noisy_model_input,
            encoder_hidden_states=prompt_embeds,
            encoder_attention_mask=prompt_attention_mask,
            timestep=timesteps,
            return_dict=False,
        )[0]

        # these weighting schemes use a uniform timestep sampling
        # and instead post-weight the loss
        weighting = compute_loss_weighting_for_sd3(
            weighting_scheme=args.weighting_scheme, sigmas=sigmas
        )

        # flow matching loss
        target = noise - model_input

        # Compute regular loss.
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        loss = loss.mean()
        return loss

    return types.SimpleNamespace(
        step=training_step,
        transformer=transformer,
        get_sigmas=get_sigmas,
    )


def _example(index: int, *, caption: bool) -> dict:
    generator = torch.Generator().manual_seed(1100 + index)
    return {
        "instance_images": torch.rand(3, 16, 16, generator=generator) * 2 - 1,
        "instance_prompt": CAPTIONS[index % len(CAPTIONS)] if caption else "a photo of sks dog",
    }


def _batch(indices, *, caption: bool) -> dict:
    return collate_fn([_example(i, caption=caption) for i in indices])


CACHED = {
    "vae_encoder__0__out",
    # Only the cached VAE encoder computes with the pixels: stage 2 holds a stand-in, the cache
    # their shape (calls/unstored_inputs).
    "pixel_values__shape",
    # The frozen work on the prompt embeddings inside the transformer: the caption projection
    # and norm, and the frozen base layers of the LoRA'd cross-attention key and value.
    "transformer_caption_projection__0__out",
    "transformer_caption_norm__0__out",
    "transformer_transformer_blocks_0_attn2_to_k_base_layer__0__out",
    "transformer_transformer_blocks_0_attn2_to_v_base_layer__0__out",
}


def assert_stage2_trains_the_transformer(split, transformer, also_held: set[str]) -> None:
    """Stage 2 holds every LoRA weight, and of the frozen modules only ``also_held`` (Gemma's
    pipeline when the captions are encoded in the step: its calls are not cached). The step
    runs ``vae = vae.to(accelerator.device)`` every step, in stage 2 too: a move to where the
    module already is computes nothing (calls/usage.py: MOVES), so the VAE is not held (it was,
    before), and stage 2 skips its move while it is on meta (tests/calls/test_module_moves.py)."""
    held = {name for name, _ in split.stage2.named_parameters()}
    lora = {f"transformer.{n}" for n, p in transformer.named_parameters() if p.requires_grad}
    assert len(lora) == 12 and lora <= held  # to_k / to_q / to_v of self- and cross-attention
    assert {name.split(".")[0] for name in held} == {"transformer"} | also_held
    assert split.to_json()["held_though_cached"] == []


@pytest.mark.parametrize("offload", [False, True])
def test_instance_prompt_caches_the_vae_and_the_mask_crosses(offload):
    parts = build(custom_instance_prompts=False, offload=offload)
    split = split_and_verify(parts.step, (_batch([0], caption=False),))
    assert split.path == "calls"
    assert line_of(parts.get_sigmas, "step_indices = [") in split.reason
    assert_stage2_trains_the_transformer(split, parts.transformer, set())
    assert "text_encoding_pipeline" in split.plan.not_held  # instance prompt: never called
    assert {key for key in split.boundary if key not in split.input_names} == CACHED


@pytest.mark.parametrize("size", [1, 2, 3])
def test_captions_encoded_in_the_step_cache_the_prompt_work_and_the_vae(size):
    parts = build(custom_instance_prompts=True)
    split = split_and_verify(parts.step, (_batch(range(size), caption=True),))
    assert split.path == "calls"
    # The first refusal: the pipeline's tokenizer needs the real captions.
    assert "a batch field of strings to code that needs the real text" in split.reason
    assert_stage2_trains_the_transformer(split, parts.transformer, {"text_encoding_pipeline"})
    assert {key for key in split.boundary if key not in split.input_names} == CACHED


def test_instance_prompt_cache_round_trip(tmp_path):
    parts = build(custom_instance_prompts=False)
    split = graphsplit.split(parts.step, (_batch([0], caption=False),))
    batches = [_batch([i], caption=False) for i in (1, 2, 3)]
    assert_cache_round_trip(
        split, parts.step, batches, tmp_path, parts.transformer, rows_per_batch=1
    )
