"""Conformance: ``examples/dreambooth/train_dreambooth_lora_hidream.py``'s loop body (HiDream LoRA).

huggingface/diffusers ``examples/dreambooth/train_dreambooth_lora_hidream.py`` (commit
58eb52c): four frozen text encoders (two ``CLIPTextModelWithProjection``, a ``T5EncoderModel``
and a ``LlamaForCausalLM`` whose every hidden state is stacked, the batch on axis 1) reached
through a ``HiDreamImagePipeline`` built with ``vae=None, transformer=None``, a frozen
``AutoencoderKL`` (scaling and shift factor), and ``HiDreamImageTransformer2DModel`` (a
mixture-of-experts DiT) frozen with peft LoRA on ``to_k/to_q/to_v/to_out`` added by
``transformer.add_adapter`` (``init_lora_weights="gaussian"``). The script's
``compute_text_embeddings``, ``get_sigmas`` and ``collate_fn`` are verbatim; the loop body is
the script's with ``--cache_latents`` off and custom instance prompts (a ``prompts`` list a
batch): the script encodes those prompts before training in its own cache loop
(``t5_prompt_cache[step]``...); the step here calls ``compute_text_embeddings(batch["prompts"],
text_encoding_pipeline)`` where that loop calls it, the rest of the body unchanged (the
``logit_normal`` weighting scheme, the ``.nonzero().item()`` of ``get_sigmas``, flow-matching
target ``noise - model_input``, ``model_pred * -1``). ``accelerator`` reads the CPU;
``accelerator.backward`` and the optimizer lines are the caller's.

What must hold: the step splits exactly (loss and every LoRA gradient bit for bit, on the
example and on a batch of another size and of another resolution, 32 x 32 then 32 x 48 px),
the four text encoders' outputs and the VAE's latent distribution are cached and none of those
modules is held by stage 2, and a cache of a loader of mixed resolutions written through the
disk trains stage 2 exactly, read back with ``CachedDataset.loader`` as aspect-ratio buckets.
The same with ``--with_prior_preservation`` (class images and the class prompt appended by
``collate_fn``, the prior loss of the chunked prediction), at the README's batch size of 1.

Tiny configs: diffusers' own HiDream pipeline-test transformer (patch 2, one double- and one
single-stream block, 4 routed experts, 2 active), CLIP encoders 32 wide with two layers, T5 32
wide, Llama 16 wide with two layers, a (8, 16) VAE (32 px -> 16 x 16 latents), word-level
tokenizers with prompts of 8 tokens.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen2_data_checks import assert_same_step  # noqa: E402
from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
    word_tokenizer,
)

WORDS = ["a", "photo", "of", "sks", "dog", "cat", "in", "the", "snow", "on", "beach", "red", "blue"]
PROMPTS = [
    "a photo of sks dog",
    "a photo of sks dog in the snow",
    "a red cat on the beach",
    "a blue dog",
    "sks cat in the snow",
    "a photo of a cat",
]
MAX_LEN = 8


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _example(index: int, height: int = 32, width: int = 32) -> dict:
    """``DreamBoothDataset``'s example: an image in [-1, 1] and its custom prompt, and a class
    image with the class prompt (read by ``collate_fn`` with prior preservation only)."""
    generator = torch.Generator().manual_seed(500 + index)
    image = torch.rand(3, height, width, generator=generator) * 2 - 1
    class_image = torch.rand(3, height, width, generator=generator) * 2 - 1
    return {
        "instance_images": image,
        "instance_prompt": PROMPTS[index % len(PROMPTS)],
        "class_images": class_image,
        "class_prompt": "a photo of dog",
    }


def _batch(first: int, size: int, height: int = 32, width: int = 32, prior: bool = False) -> dict:
    examples = [_example(i, height, width) for i in range(first, first + size)]
    return collate_fn(examples, prior)


def _models():
    torch.manual_seed(0)
    transformer = diffusers.HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[32, 16],
        text_emb_dim=64,
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32),
        llama_layers=(0, 1),
        force_inference_output=True,  # as the script's from_pretrained sets it
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    vocab = 64
    clip_config = transformers.CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=2,
        hidden_size=32,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=2,
        pad_token_id=1,
        vocab_size=vocab,
        hidden_act="gelu",
        projection_dim=32,
        max_position_embeddings=MAX_LEN,
    )
    torch.manual_seed(0)
    text_encoder_one = transformers.CLIPTextModelWithProjection(clip_config)
    torch.manual_seed(1)
    text_encoder_two = transformers.CLIPTextModelWithProjection(clip_config)
    torch.manual_seed(2)
    text_encoder_three = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=vocab, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4
        )
    )
    torch.manual_seed(3)
    text_encoder_four = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=2,
        )
    )
    text_encoder_four.generation_config.pad_token_id = 1
    for model in (vae, text_encoder_one, text_encoder_two, text_encoder_three, text_encoder_four):
        model.eval()  # as from_pretrained returns them
    return (
        transformer,
        vae,
        text_encoder_one,
        text_encoder_two,
        text_encoder_three,
        text_encoder_four,
    )


def build(with_prior_preservation: bool = False):
    """``main()``'s models, ``compute_text_embeddings`` and ``get_sigmas``, and the loop body."""
    (
        transformer,
        vae,
        text_encoder_one,
        text_encoder_two,
        text_encoder_three,
        text_encoder_four,
    ) = _models()
    tokenizer_one, tokenizer_two, tokenizer_three = (word_tokenizer(WORDS) for _ in range(3))
    tokenizer_four = word_tokenizer(WORDS)
    tokenizer_four.pad_token = tokenizer_four.eos_token
    args = types.SimpleNamespace(
        max_sequence_length=MAX_LEN,
        cache_latents=False,
        offload=False,
        weighting_scheme="logit_normal",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        with_prior_preservation=with_prior_preservation,
        prior_loss_weight=1.0,
        rank=4,
        lora_dropout=0.0,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    weight_dtype = torch.float32
    train_dataset = types.SimpleNamespace(custom_instance_prompts=True)

    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)

    # We only train the additional adapter LoRA layers
    transformer.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    text_encoder_three.requires_grad_(False)
    text_encoder_four.requires_grad_(False)

    text_encoding_pipeline = diffusers.HiDreamImagePipeline(
        scheduler=noise_scheduler,
        vae=None,
        transformer=None,
        text_encoder=text_encoder_one,
        tokenizer=tokenizer_one,
        text_encoder_2=text_encoder_two,
        tokenizer_2=tokenizer_two,
        text_encoder_3=text_encoder_three,
        tokenizer_3=tokenizer_three,
        text_encoder_4=text_encoder_four,
        tokenizer_4=tokenizer_four,
    )

    target_modules = ["to_k", "to_q", "to_v", "to_out"]

    # now we will add new LoRA weights the transformer layers
    transformer_lora_config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=args.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=target_modules,
    )
    torch.manual_seed(4)
    transformer.add_adapter(transformer_lora_config)
    transformer.train()

    def compute_text_embeddings(prompt, text_encoding_pipeline):
        with torch.no_grad():
            (
                t5_prompt_embeds,
                negative_prompt_embeds_t5,
                llama3_prompt_embeds,
                negative_prompt_embeds_llama3,
                pooled_prompt_embeds,
                negative_pooled_prompt_embeds,
            ) = text_encoding_pipeline.encode_prompt(
                prompt=prompt, max_sequence_length=args.max_sequence_length
            )
        return (
            t5_prompt_embeds,
            llama3_prompt_embeds,
            pooled_prompt_embeds,
            negative_prompt_embeds_t5,
            negative_prompt_embeds_llama3,
            negative_pooled_prompt_embeds,
        )

    vae_config_scaling_factor = vae.config.scaling_factor
    vae_config_shift_factor = vae.config.shift_factor

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(accelerator.device)
        timesteps = timesteps.to(accelerator.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def training_step(batch):
        prompts = batch["prompts"]
        # encode batch prompts when custom prompts are provided for each image -
        if train_dataset.custom_instance_prompts:
            # (the script's pre-training cache loop, called where the loop reads its cache)
            t5_prompt_embeds, llama3_prompt_embeds, pooled_prompt_embeds, _, _, _ = (
                compute_text_embeddings(prompts, text_encoding_pipeline)
            )
        # Convert images to latent space
        pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
        model_input = vae.encode(pixel_values).latent_dist.sample()

        model_input = (model_input - vae_config_shift_factor) * vae_config_scaling_factor
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
            encoder_hidden_states_t5=t5_prompt_embeds,
            encoder_hidden_states_llama3=llama3_prompt_embeds,
            pooled_embeds=pooled_prompt_embeds,
            timesteps=timesteps,
            return_dict=False,
        )[0]
        model_pred = model_pred * -1
        # these weighting schemes use a uniform timestep sampling
        # and instead post-weight the loss
        weighting = compute_loss_weighting_for_sd3(
            weighting_scheme=args.weighting_scheme, sigmas=sigmas
        )

        target = noise - model_input
        if args.with_prior_preservation:
            # Chunk the noise and model_pred into two parts and compute the loss on each part
            # separately.
            model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
            target, target_prior = torch.chunk(target, 2, dim=0)

            # Compute prior loss
            prior_loss = torch.mean(
                (
                    weighting.float() * (model_pred_prior.float() - target_prior.float()) ** 2
                ).reshape(target_prior.shape[0], -1),
                1,
            )
            prior_loss = prior_loss.mean()

        # Compute regular loss.
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        loss = loss.mean()

        if args.with_prior_preservation:
            # Add the prior loss to the instance loss.
            loss = loss + args.prior_loss_weight * prior_loss
        return loss

    params = [p for p in transformer.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        transformer=transformer,
        params=params,
        frozen=(vae, text_encoder_one, text_encoder_two, text_encoder_three, text_encoder_four),
    )


_BUILT: list = []


def _built():
    if not _BUILT:
        parts = build()
        _BUILT.append((parts, graphsplit.split(parts.step, (_batch(0, 2),))))
    return _BUILT[0]


def test_hidream_step_verifies_on_other_sizes_and_resolutions():
    parts, split = _built()
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(0, 2), _batch(2, 3), _batch(1, 2, 32, 48)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_hidream_caches_the_encoders_and_the_vae():
    parts, split = _built()
    held = stage2_top_modules(split)
    assert "transformer" in held
    frozen_params = {id(p) for module in parts.frozen for p in module.parameters()}
    assert not any(id(p) in frozen_params for p in split.stage2.parameters()), held
    trainable = {id(p) for p in split.stage2.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in parts.params}
    # The step reads its strings, so the module-level path takes it: every frozen call's
    # outputs are cached, the prompts' per sample, the negative prompt's ("") once.
    assert split.path == "calls"
    dims = {key: spec.batch_dim for key, spec in split.boundary.items()}
    assert dims["vae_quant_conv__0__out"] == 0  # the latent distribution, resampled
    prefix = "text_encoding_pipeline_"
    for key in (
        "text_encoder__0__text_embeds",
        "text_encoder_2__0__text_embeds",
        "text_encoder_3__0__last_hidden_state",
        "text_encoder_4__0__hidden_states__1",
        "text_encoder_4__0__hidden_states__2",
    ):
        assert dims[prefix + key] == 0, key
    assert dims[prefix + "text_encoder_4__1__hidden_states__1"] is None


def test_hidream_cache_of_mixed_resolutions_trains_stage2(tmp_path):
    """A loader of two resolutions (aspect-ratio buckets, batches of 2), cached through the
    disk: each raw batch's rows train stage 2 as the unsplit step trains on the raw batch, and
    ``CachedDataset.loader`` batches the cache one bucket a batch with no bucket loop."""
    parts, split = _built()
    loader = [_batch(0, 2), _batch(2, 2, 32, 48), _batch(4, 2), _batch(6, 2, 32, 48)]
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    data = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(data) == 8
    assert len(data.buckets()) == 2
    row = 0
    for seed, raw in enumerate(loader):
        size = len(raw["prompts"])
        rows = [data[row + offset] for offset in range(size)]
        row += size
        assert_same_step(
            lambda raw=raw: parts.step(raw),
            lambda rows=rows: split.stage2(**graphsplit.collate(rows)),
            parts.params,
            seed,
        )
    shuffled = data.loader(batch_size=2, seed=0)
    assert len(shuffled) == 4
    widths = []
    for batch in shuffled:
        loss = split.stage2(**batch)
        loss.backward()
        widths.append(batch["pixel_values__shape"][0, -1].item())
    assert sorted(widths) == [32, 32, 48, 48]
    for param in parts.params:
        param.grad = None


def test_hidream_prior_preservation_verifies_and_round_trips(tmp_path):
    """``--with_prior_preservation`` at the README's ``--train_batch_size=1``: ``collate_fn``
    appends the class image and the class prompt, the step chunks the prediction in two and
    adds the prior loss. One example is 2 cached rows (instance, then class). (At two examples
    or more the script's own step raises: ``weighting`` keeps the 2B rows of ``sigmas`` while
    ``model_pred`` is chunked to B; the broadcast only works at B = 1.)"""
    parts = build(with_prior_preservation=True)
    split = graphsplit.split(parts.step, (_batch(0, 1, prior=True),))
    for seed, batch in enumerate([_batch(0, 1, prior=True), _batch(2, 1, 32, 48, prior=True)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    frozen_params = {id(p) for module in parts.frozen for p in module.parameters()}
    assert not any(id(p) in frozen_params for p in split.stage2.parameters())
    assert_cache_round_trip(
        split,
        parts.step,
        [_batch(0, 1, prior=True), _batch(2, 1, 32, 48, prior=True), _batch(3, 1, prior=True)],
        tmp_path,
        parts.transformer,
        rows_per_batch=2,
    )
