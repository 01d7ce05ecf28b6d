"""Conformance: ``examples/cogview4-control/train_control_cogview4.py``'s training step.

diffusers has no ``train_dreambooth_lora_cogview4.py``; its CogView4 training example is the
Control one: the whole ``CogView4Transformer2DModel`` trained (``requires_grad_(True)``), its
``patch_embed.proj`` widened to take the control image's latents beside the noisy latents
(the new input columns zero-initialised). The loop body, copied: the captions tokenized for
the ``attention_mask`` (``padding="longest"``); ``encode_images`` on the frozen VAE for the
target image and for the control image (``vae.to(accelerator.device)`` each step, shift and
scaling factors); noise, ``compute_density_for_timestep_sampling`` and CogView4's resolution
-dependent shift of the sigmas (``mu = sqrt(image_seq_len / 256) * 0.75 + 0.25``); the noisy
latents concatenated with the control latents along the channels; the captions encoded by a
``CogView4ControlPipeline`` holding only the tokenizer and the frozen GLM text encoder
(``text_encoding_pipeline.encode_prompt(captions, "")`` under ``torch.no_grad()``: the
penultimate hidden states of the captions and of the empty negative prompt, each padded on the
left to a multiple of 16 tokens); ``original_size`` / ``target_size`` / crop coordinates as
tensors; ``--proportion_empty_prompts`` (a ``random.random()`` draw after both encodings,
swapping in the empty prompt's embedding); the weighted flow-matching loss.

Changes: ``text_encoding_pipeline.to("cuda")`` moves to ``accelerator.device`` (the CPU); the
pipeline is built from the tiny components (``from_pretrained`` with ``transformer=None,
vae=None``); one process, fp32; the backward, clipping and optimizer step are the caller's.
The script hands the transformer the tokenizer's mask of the ``longest`` caption beside
embeddings padded to a multiple of 16: the two agree only when the longest caption is a
multiple of 16 tokens (else the transformer's attention raises in the script itself), so the
captions here tokenize to 16.

What must hold: the step splits exactly (loss and every transformer gradient bit for bit, on
the example and on a batch of another size), the VAE's latent distributions of both images and
the GLM embeddings (the captions' and the negative prompt's) are cached, stage 2 holds no VAE
encoder and no text encoder weight, and a cache written through the disk trains stage 2
exactly, also with ``--proportion_empty_prompts`` (the draw comes after the frozen calls).

Tiny configs: diffusers' ``tests/pipelines/cogview4/test_cogview4.py`` components (transformer
patch 2, 2 layers of 4 heads of 4, text embed 32, time embed 8, condition dim 4; VAE (32, 64)
channels, 4 latent channels; GLM 32 wide, 2 layers, head dim 8), a real word-level tokenizer,
16 px images (8 x 8 latents, 16 image tokens).
"""

from __future__ import annotations

import copy
import random
import types

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen2_checks import cached_outputs  # noqa: E402
from tests.conformance.unseen2_data_checks import (  # noqa: E402
    assert_cache_round_trip,
    assert_same_step,
)
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

WORDS = ["a", "tarot", "card", "of", "the", "fool", "walking", "on", "cliff", "edge", "with"]
WORDS += ["white", "dog", "sun", "in", "sky", "ink"]
# 15 words and the end token: 16 tokens, the embeddings' multiple of 16 (see the docstring).
CAPTIONS = [
    "a tarot card of the fool walking on the cliff edge with a white dog",
    "the sun in the sky on a tarot card of the fool with a dog",
    "a white dog walking on the cliff edge in ink with the sun in sky",
    "ink tarot card of a fool with a dog on the edge of a cliff",
]
assert all(len(caption.split()) == 15 for caption in CAPTIONS)
RESOLUTION = 16


def encode_images(pixels: torch.Tensor, vae: torch.nn.Module, weight_dtype):
    """The script's, verbatim."""
    pixel_latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample()
    pixel_latents = (pixel_latents - vae.config.shift_factor) * vae.config.scaling_factor
    return pixel_latents.to(weight_dtype)


def collate_fn(examples):
    """The script's, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    conditioning_pixel_values = torch.stack(
        [example["conditioning_pixel_values"] for example in examples]
    )
    conditioning_pixel_values = conditioning_pixel_values.to(
        memory_format=torch.contiguous_format
    ).float()
    captions = [example["captions"] for example in examples]
    return {
        "pixel_values": pixel_values,
        "conditioning_pixel_values": conditioning_pixel_values,
        "captions": captions,
    }


def _models():
    torch.manual_seed(0)
    transformer = diffusers.CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=4,
        num_attention_heads=4,
        out_channels=4,
        text_embed_dim=32,
        time_embed_dim=8,
        condition_dim=4,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        sample_size=128,
        shift_factor=0.0609,  # CogView4's VAE has one; the tiny test VAE has none
    )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        base_shift=0.25,
        max_shift=0.75,
        base_image_seq_len=256,
        use_dynamic_shifting=True,
        time_shift_type="linear",
    )
    torch.manual_seed(0)
    text_encoder = transformers.GlmModel(
        transformers.GlmConfig(
            vocab_size=len(WORDS) + 3,
            hidden_size=32,
            intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            head_dim=8,
            pad_token_id=0,
        )
    )
    tokenizer = word_tokenizer(WORDS)
    for model in (transformer, vae, text_encoder):
        model.eval()  # as from_pretrained returns them
    return transformer, vae, scheduler, text_encoder, tokenizer


def build(*, proportion_empty_prompts: float = 0):
    """``main()``'s setup (``--only_target_transformer_blocks`` off) and the loop body as a
    closure."""
    cogview4_transformer, vae, noise_scheduler, text_encoder, tokenizer_ = _models()
    args = types.SimpleNamespace(
        only_target_transformer_blocks=False,
        resolution=RESOLUTION,
        max_sequence_length=128,
        weighting_scheme="none",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        proportion_empty_prompts=proportion_empty_prompts,
        offload=False,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    if not args.only_target_transformer_blocks:
        cogview4_transformer.requires_grad_(True)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)  # as from_pretrained in the pipeline, never trained

    weight_dtype = torch.float32
    vae.to(dtype=torch.float32)  # keep the VAE in float32.

    # enable image inputs
    with torch.no_grad():
        patch_size = cogview4_transformer.config.patch_size
        initial_input_channels = cogview4_transformer.config.in_channels * patch_size**2
        new_linear = torch.nn.Linear(
            cogview4_transformer.patch_embed.proj.in_features * 2,
            cogview4_transformer.patch_embed.proj.out_features,
            bias=cogview4_transformer.patch_embed.proj.bias is not None,
            dtype=cogview4_transformer.dtype,
            device=cogview4_transformer.device,
        )
        new_linear.weight.zero_()
        new_linear.weight[:, :initial_input_channels].copy_(
            cogview4_transformer.patch_embed.proj.weight
        )
        if cogview4_transformer.patch_embed.proj.bias is not None:
            new_linear.bias.copy_(cogview4_transformer.patch_embed.proj.bias)
        cogview4_transformer.patch_embed.proj = new_linear

    assert torch.all(
        cogview4_transformer.patch_embed.proj.weight[:, initial_input_channels:].data == 0
    )
    cogview4_transformer.register_to_config(
        in_channels=cogview4_transformer.config.in_channels * 2,
        out_channels=cogview4_transformer.config.in_channels,
    )
    with torch.no_grad():  # as after some steps: the control columns moved from zero
        cogview4_transformer.patch_embed.proj.weight[:, initial_input_channels:].normal_(std=0.02)

    # Create a pipeline for text encoding. We will move this pipeline to GPU/CPU as needed.
    text_encoding_pipeline = diffusers.CogView4ControlPipeline(
        tokenizer=tokenizer_,
        text_encoder=text_encoder,
        vae=None,
        transformer=None,
        scheduler=copy.deepcopy(noise_scheduler),
    )
    tokenizer = text_encoding_pipeline.tokenizer
    cogview4_transformer.train()

    def training_step(batch):
        nonlocal text_encoding_pipeline
        # Convert images to latent space
        # vae encode
        prompts = batch["captions"]
        attention_mask = tokenizer(
            prompts,
            padding="longest",  # not use max length
            max_length=args.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).attention_mask.float()

        pixel_latents = encode_images(
            batch["pixel_values"], vae.to(accelerator.device), weight_dtype
        )
        control_latents = encode_images(
            batch["conditioning_pixel_values"], vae.to(accelerator.device), weight_dtype
        )
        if args.offload:
            vae.cpu()

        # Sample a random timestep for each image
        # for weighting schemes where we sample timesteps non-uniformly
        bsz = pixel_latents.shape[0]
        noise = torch.randn_like(pixel_latents, device=accelerator.device, dtype=weight_dtype)
        u = compute_density_for_timestep_sampling(
            weighting_scheme=args.weighting_scheme,
            batch_size=bsz,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
        )

        # Add noise according for cogview4
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices].to(device=pixel_latents.device)
        sigmas = noise_scheduler_copy.sigmas[indices].to(device=pixel_latents.device)
        captions = batch["captions"]
        image_seq_lens = torch.tensor(
            pixel_latents.shape[2] * pixel_latents.shape[3] // patch_size**2,
            dtype=pixel_latents.dtype,
            device=pixel_latents.device,
        )  # H * W  / VAE patch_size
        mu = torch.sqrt(image_seq_lens / 256)
        mu = mu * 0.75 + 0.25
        scale_factors = mu / (mu + (1 / sigmas - 1) ** 1.0).to(
            dtype=pixel_latents.dtype, device=pixel_latents.device
        )
        scale_factors = scale_factors.view(len(batch["captions"]), 1, 1, 1)
        noisy_model_input = (1.0 - scale_factors) * pixel_latents + scale_factors * noise
        concatenated_noisy_model_input = torch.cat([noisy_model_input, control_latents], dim=1)
        text_encoding_pipeline = text_encoding_pipeline.to(accelerator.device)  # "cuda"

        with torch.no_grad():
            (
                prompt_embeds,
                pooled_prompt_embeds,
            ) = text_encoding_pipeline.encode_prompt(captions, "")
        original_size = (args.resolution, args.resolution)
        original_size = torch.tensor(
            [original_size], dtype=prompt_embeds.dtype, device=prompt_embeds.device
        )

        target_size = (args.resolution, args.resolution)
        target_size = torch.tensor(
            [target_size], dtype=prompt_embeds.dtype, device=prompt_embeds.device
        )

        target_size = target_size.repeat(len(batch["captions"]), 1)
        original_size = original_size.repeat(len(batch["captions"]), 1)
        crops_coords_top_left = torch.tensor(
            [(0, 0)], dtype=prompt_embeds.dtype, device=prompt_embeds.device
        )
        crops_coords_top_left = crops_coords_top_left.repeat(len(batch["captions"]), 1)

        # this could be optimized by not having to do any text encoding and just
        # doing zeros on specified shapes for `prompt_embeds` and `pooled_prompt_embeds`
        if args.proportion_empty_prompts and random.random() < args.proportion_empty_prompts:
            # Here, we directly pass 16 pad tokens from pooled_prompt_embeds to prompt_embeds.
            prompt_embeds = pooled_prompt_embeds
        if args.offload:
            text_encoding_pipeline = text_encoding_pipeline.to("cpu")
        # Predict.
        noise_pred_cond = cogview4_transformer(
            hidden_states=concatenated_noisy_model_input,
            encoder_hidden_states=prompt_embeds,
            timestep=timesteps,
            original_size=original_size,
            target_size=target_size,
            crop_coords=crops_coords_top_left,
            return_dict=False,
            attention_mask=attention_mask,
        )[0]
        # these weighting schemes use a uniform timestep sampling
        # and instead post-weight the loss
        weighting = compute_loss_weighting_for_sd3(
            weighting_scheme=args.weighting_scheme, sigmas=sigmas
        )
        # flow-matching loss
        target = noise - pixel_latents

        weighting = weighting.view(len(batch["captions"]), 1, 1, 1)
        loss = torch.mean(
            (weighting.float() * (noise_pred_cond.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        loss = loss.mean()
        return loss

    params = [p for p in cogview4_transformer.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        transformer=cogview4_transformer,
        vae=vae,
        text_encoder=text_encoder,
        params=params,
    )


def _example(index: int) -> dict:
    """``prepare_train_dataset``'s transform: both images in [-1, 1] and the caption."""
    generator = torch.Generator().manual_seed(500 + index)
    image, control = torch.rand(2, 3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1
    return {
        "pixel_values": image,
        "conditioning_pixel_values": control,
        "captions": CAPTIONS[index % len(CAPTIONS)],
    }


def _batch(indices) -> dict:
    return collate_fn([_example(i) for i in indices])


_BUILT: dict = {}


def _built(proportion_empty_prompts: float = 0):
    if proportion_empty_prompts not in _BUILT:
        parts = build(proportion_empty_prompts=proportion_empty_prompts)
        split = graphsplit.split(parts.step, (_batch([0, 1]),))
        _BUILT[proportion_empty_prompts] = (parts, split)
    return _BUILT[proportion_empty_prompts]


def test_the_trace_refuses_the_tokenizer_on_the_captions_naming_the_line():
    parts = build()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    assert line_of(parts.step, "attention_mask = tokenizer(") in str(caught.value)


def test_cogview4_control_step_verifies_on_the_example_and_another_size():
    parts, split = _built()
    assert split.path == "calls"
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_cogview4_control_caches_both_latent_distributions_and_the_glm_embeddings():
    parts, split = _built()
    per_sample = {key: tuple(spec.shape[1:]) for key, spec in split.boundary.items()}
    # The VAE's moments (mean and log-variance of 4 channels, 8 x 8) of each image, and GLM's
    # penultimate hidden states of the captions and of the negative prompt (16 tokens each;
    # the negative one is unused without --proportion_empty_prompts, but the step holds it).
    assert {key: per_sample[key] for key in cached_outputs(split)} == {
        "vae_quant_conv__0__out": (8, 8, 8),
        "vae_quant_conv__1__out": (8, 8, 8),
        "text_encoding_pipeline_text_encoder__0__hidden_states__1": (16, 32),
        "text_encoding_pipeline_text_encoder__1__hidden_states__1": (16, 32),
    }
    assert set(split.plan.unstored) == {"pixel_values", "conditioning_pixel_values"}
    # Stage 2 holds the transformer alone: no VAE, no pipeline's text encoder.
    assert stage2_top_modules(split) == {"cogview4_transformer"}
    stage1 = {".".join(n.split(".")[:1]) for n, _ in split.stage1.named_parameters()}
    assert stage1 == {"vae", "text_encoding_pipeline"}  # its text_encoder, under the pipeline
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    expected = {f"cogview4_transformer.{n}" for n, _ in parts.transformer.named_parameters()}
    assert trainable == expected


def test_cogview4_control_cache_round_trip(tmp_path):
    parts, split = _built()
    loader = [_batch([5, 6]), _batch([7, 8, 9]), _batch([10])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)


def test_proportion_empty_prompts_draws_after_the_frozen_calls_and_trains_exactly(tmp_path):
    """``--proportion_empty_prompts 0.5``: the draw swaps in the empty prompt's embedding
    after both encodings; both are cached, stage 2 draws and picks as the step does. Python's
    ``random`` is seeded alike before the unsplit step and before stage 2 (``torch.manual_seed``
    does not seed it)."""
    parts, split = _built(0.5)
    loader = [_batch([5, 6]), _batch([7, 8, 9]), _batch([10]), _batch([11, 12])]
    draws = []
    for seed in range(len(loader)):
        random.seed(seed)
        draws.append(random.random() < 0.5)
    assert any(draws) and not all(draws)  # both branches are compared below
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    row = 0
    for seed, raw in enumerate(loader):
        size = len(raw["captions"])
        rows = [cached[row + offset] for offset in range(size)]
        row += size

        def expected(raw=raw, seed=seed):
            random.seed(seed)
            return parts.step(raw)

        def actual(rows=rows, seed=seed):
            random.seed(seed)
            return split.stage2(**graphsplit.collate(rows))

        assert_same_step(expected, actual, parts.params, seed)
    assert row == len(cached)
