"""Conformance: AnimateDiff motion-module training, guoyww/AnimateDiff ``train.py``'s loop body.

The script trains the motion modules of a UNet inflated from a frozen Stable Diffusion UNet
(``configs/training/v1/training.yaml``: ``trainable_modules: ["motion_modules."]``), the
rest of the UNet, the VAE and the CLIP text encoder frozen. Its loop body, copied: the clip
``[b, f, c, h, w]`` folded into the batch (``rearrange(pixel_values, "b f c h w -> (b f) c h
w")``) through the frozen VAE under ``torch.no_grad()``, the latents sampled and unfolded to
``b c f h w`` (``rearrange(latents, "(b f) c h w -> b c f h w", f=video_length)``), times
0.18215; DDIM-scheduler noise and timesteps; the captions tokenized in the step and embedded
by CLIP under ``torch.no_grad()``; the UNet's epsilon prediction and the mean squared error,
inside ``torch.cuda.amp.autocast(enabled=mixed_precision_training)``. The script's
``cfg_random_null_text`` (on by default, ratio 0.1, not set by its training configs) replaces
each caption with ``""`` when a ``random.random()`` draw falls at or below the ratio.

Changes: diffusers' ``UNetMotionModel.from_unet2d(unet, motion_adapter)`` stands for the
repository's own ``UNet3DConditionModel.from_pretrained_2d`` (the same inflation: a frozen 2D
UNet with temporal motion modules after each block; its input is ``b c f h w`` as the
script's; it takes the prompt embedding per frame, so the step repeats it ``video_length``
times before the call, as diffusers' ``AnimateDiffPipeline`` does); ``local_rank`` is the
CPU; no DDP wrapper; fp32 (``mixed_precision_training`` off); the backward, clipping and
optimizer step are the caller's.

What must hold: the step splits exactly (loss and every motion-module gradient bit for bit, on
the example and on a batch of another size); the CLIP embedding of the captions is cached;
the frozen VAE's latent distribution of the clip's frames (a function of the sample alone) is
cached; and a cache written through the disk trains stage 2 exactly.

Tiny configs: diffusers' ``tests/pipelines/animatediff/test_animatediff.py`` components (UNet
and motion adapter (32, 64) channels, 2 norm groups, 4 motion heads; CLIP 32 wide), with one
layer a block where the test has two (CLIP at 2 layers where it has 5), a VAE of (8, 16)
channels, a real word-level tokenizer, clips of 4 frames of 16 px (8 x 8 latents).
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
einops = pytest.importorskip("einops")

from einops import rearrange  # noqa: E402

from tests.conformance.unseen2_data_checks import (  # noqa: E402
    assert_cache_round_trip,
    assert_same_step,
)
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

WORDS = ["snow", "rocky", "mountains", "robot", "dancing", "in", "times", "square", "ocean"]
CAPTIONS = ["snow rocky mountains", "robot dancing in times square", "ocean", "rocky ocean"]
FRAMES, SIZE = 4, 16


def _models():
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,  # 2 in diffusers' test
        sample_size=SIZE // 2,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=2,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=[8, 16],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        norm_num_groups=8,
        sample_size=SIZE,
    )
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=2,
            hidden_size=32,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=2,  # 5 in diffusers' test
            pad_token_id=1,
            vocab_size=len(WORDS) + 3,
        )
    )
    tokenizer = word_tokenizer(WORDS)
    tokenizer.model_max_length = 8  # CLIP's 77, shortened
    torch.manual_seed(0)
    motion_adapter = diffusers.MotionAdapter(
        block_out_channels=(32, 64),
        motion_layers_per_block=1,  # 2 in diffusers' test
        motion_norm_num_groups=2,
        motion_num_attention_heads=4,
    )
    torch.manual_seed(0)
    with torch.no_grad():  # as a trained adapter: its zero-initialised out projections moved
        for name, param in motion_adapter.named_parameters():
            if "proj_out" in name:
                param.normal_(std=0.02)
    unet = diffusers.UNetMotionModel.from_unet2d(unet, motion_adapter)
    for model in (unet, vae, text_encoder):
        model.eval()  # as from_pretrained returns them
    return vae, tokenizer, text_encoder, unet


def build(*, cfg_random_null_text: bool):
    """``main()``'s setup and the loop body as a closure (``image_finetune`` false)."""
    vae, tokenizer, text_encoder, unet = _models()
    noise_scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="linear",
        steps_offset=1,
        clip_sample=False,
    )
    image_finetune = False
    cfg_random_null_text_ratio = 0.1
    mixed_precision_training = False
    trainable_modules = ["motion_modules."]
    local_rank = "cpu"

    # Freeze vae and text_encoder
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)

    # Set unet trainable parameters
    unet.requires_grad_(False)
    for name, param in unet.named_parameters():
        for trainable_module_name in trainable_modules:
            if trainable_module_name in name:
                param.requires_grad = True
                break

    unet.train()

    def training_step(batch):
        if cfg_random_null_text:
            batch["text"] = [
                name if random.random() > cfg_random_null_text_ratio else ""
                for name in batch["text"]
            ]

        ### >>>> Training >>>> ###

        # Convert videos to latent space
        pixel_values = batch["pixel_values"].to(local_rank)
        video_length = pixel_values.shape[1]
        with torch.no_grad():
            if not image_finetune:
                pixel_values = rearrange(pixel_values, "b f c h w -> (b f) c h w")
                latents = vae.encode(pixel_values).latent_dist
                latents = latents.sample()
                latents = rearrange(latents, "(b f) c h w -> b c f h w", f=video_length)
            else:
                latents = vae.encode(pixel_values).latent_dist
                latents = latents.sample()

            latents = latents * 0.18215

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]

        # Sample a random timestep for each video
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()

        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        # Get the text embedding for conditioning
        with torch.no_grad():
            prompt_ids = tokenizer(
                batch["text"],
                max_length=tokenizer.model_max_length,
                padding="max_length",
                truncation=True,
                return_tensors="pt",
            ).input_ids.to(latents.device)
            encoder_hidden_states = text_encoder(prompt_ids)[0]

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        # Predict the noise residual and compute loss
        # Mixed-precision training
        with torch.cuda.amp.autocast(enabled=mixed_precision_training):
            # diffusers' UNetMotionModel takes the prompt embedding per frame, as
            # AnimateDiffPipeline hands it (``prompt_embeds.repeat_interleave(repeats=
            # num_frames, dim=0)``); AnimateDiff's UNet3DConditionModel repeats it inside.
            encoder_hidden_states = encoder_hidden_states.repeat_interleave(video_length, dim=0)
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
            del model_pred
            del target
        return loss

    params = [p for p in unet.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step, unet=unet, vae=vae, text_encoder=text_encoder, params=params
    )


def _batch(indices) -> dict:
    """``WebVid10M``'s samples, batched by the default collate: ``pixel_values`` ``[b, f, c, h,
    w]`` in [-1, 1] and ``text`` (a list of captions)."""
    pixels = []
    for index in indices:
        generator = torch.Generator().manual_seed(300 + index)
        pixels.append(torch.rand(FRAMES, 3, SIZE, SIZE, generator=generator) * 2 - 1)
    return {
        "pixel_values": torch.stack(pixels),
        "text": [CAPTIONS[index % len(CAPTIONS)] for index in indices],
    }


_BUILT: dict = {}


def _built(cfg_random_null_text: bool = False):
    if cfg_random_null_text not in _BUILT:
        parts = build(cfg_random_null_text=cfg_random_null_text)
        split = graphsplit.split(parts.step, (_batch([0, 1]),))
        _BUILT[cfg_random_null_text] = (parts, split)
    return _BUILT[cfg_random_null_text]


def test_the_trace_refuses_the_tokenizer_on_the_captions_naming_the_line():
    parts = build(cfg_random_null_text=False)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    assert line_of(parts.step, "prompt_ids = tokenizer(") in str(caught.value)


def test_animatediff_step_verifies_on_the_example_and_another_size():
    parts, split = _built()
    assert split.path == "calls"
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_animatediff_caches_the_text_embedding_and_trains_only_the_motion_modules():
    parts, split = _built()
    per_sample = {key: tuple(spec.shape[1:]) for key, spec in split.boundary.items()}
    assert per_sample["text_encoder__0__last_hidden_state"] == (8, 32)
    assert "text_encoder" not in stage2_top_modules(split)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith("text_encoder.") for name in held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    expected = {f"unet.{n}" for n, p in parts.unet.named_parameters() if p.requires_grad}
    assert trainable == expected
    assert expected and all(".motion_modules." in name for name in expected)


def test_animatediff_caches_the_frame_latents():
    """The clip's frames reach the VAE as ``(b f) c h w`` (``FRAMES`` rows a sample, grouped):
    cached one clip an entry, and stage 2 holds no VAE encoder (graphsplit.calls.row_folds)."""
    _parts, split = _built()
    folded = {key: spec for key, spec in split.boundary.items() if key.startswith("vae")}
    assert folded, sorted(split.boundary)
    assert all(spec.shape[1] == FRAMES and spec.batch_dim == 0 for spec in folded.values())
    assert not any(name.startswith("vae.encoder") for name, _ in split.stage2.named_parameters())
    stored = [v for v in split.plan.verdicts if v.path == "vae.quant_conv" and v.cached]
    assert stored and f"{FRAMES} rows a sample, grouped" in stored[0].line(), stored


def test_animatediff_cache_round_trip(tmp_path):
    parts, split = _built()
    loader = [_batch([5, 6]), _batch([7, 8, 9]), _batch([10])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)


def _first_seed_dropping_a_caption(ratio: float, batch_size: int) -> int:
    for seed in range(1000):
        random.seed(seed)
        if any(random.random() <= ratio for _ in range(batch_size)):
            return seed
    raise AssertionError(ratio)


def test_cfg_random_null_text_trains_from_the_cache_as_the_step(tmp_path):
    """The script's default nulls each caption when ``random.random() <= 0.1``, in the step
    before the tokenizer. Neither probe seed nulls one (draws 0.84, 0.76 and 0.13, 0.85), so
    the CLIP call was cached and a stage-2 step that nulled a caption trained on its
    embedding, silently (a strict xfail). The forced-draw runs (calls/forced_draws) see the
    branch: the text encoder's call is not cached, and stage 2 trains as the step."""
    parts, split = _built(cfg_random_null_text=True)
    assert split.path == "calls"
    assert not any(key.startswith("text_encoder__") for key in split.boundary)  # its output
    assert "forced to the bottom of their range" in split.report()
    raw = _batch([2, 3])
    random.seed(0)  # draws 0.84, 0.76: no caption nulled while caching
    graphsplit.cache(split, [dict(raw)], tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    rows = [cached[0], cached[1]]
    null = _first_seed_dropping_a_caption(0.1, 2)

    def expected():
        random.seed(null)
        return parts.step(dict(raw))  # the step rewrites batch["text"]: a fresh dict a run

    def actual():
        random.seed(null)
        return split.stage2(**graphsplit.collate(rows))

    assert_same_step(expected, actual, parts.params, 0)
