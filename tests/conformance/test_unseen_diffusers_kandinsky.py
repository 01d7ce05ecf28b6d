"""Conformance: ``examples/kandinsky2_2/text_to_image/train_text_to_image_decoder.py``'s step.

Kandinsky 2.2's decoder is conditioned on an *image* embedding: the frozen
``CLIPVisionModelWithProjection`` encodes ``clip_pixel_values`` and the frozen MoVQ
(``VQModel``) encodes the pixels (``vae.encode(images).latents``: no distribution, so the
latents themselves are cached); the UNet (``addition_embed_type="image"``,
``encoder_hid_dim_type="image_proj"``) is trained in full, its output cut to ``[:, :4]``,
with min-SNR weighting. The configs are diffusers' own tiny Kandinsky 2.2 test configs. (The
LoRA variant of the script builds ``LoRAAttnAddedKVProcessor(hidden_size=...)``, which the
installed diffusers no longer accepts: it cannot run as written.)
Stage 1 must hold the image encoder and MoVQ; stage 2 the UNet alone. Two resolutions
(the script's ``--resolution``) each verify exactly, and batches of both sizes round-trip
through one cache.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
from diffusers.training_utils import compute_snr  # noqa: E402

from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
)


def build(seed: int = 0):
    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(
        in_channels=4,
        out_channels=8,  # predicts mean and variance
        addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn",
        block_out_channels=(32, 64),
        layers_per_block=1,
        encoder_hid_dim=32,
        encoder_hid_dim_type="image_proj",
        cross_attention_dim=32,
        attention_head_dim=4,
        resnet_time_scale_shift="scale_shift",
        class_embed_type=None,
    )
    vae = diffusers.VQModel(
        block_out_channels=[32, 64],
        down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
        in_channels=3,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        norm_type="spatial",
        num_vq_embeddings=12,
        out_channels=3,
        up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
        vq_embed_dim=4,
    )
    image_encoder = transformers.CLIPVisionModelWithProjection(
        transformers.CLIPVisionConfig(
            hidden_size=32,
            image_size=28,
            projection_dim=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_channels=3,
            num_hidden_layers=2,
            patch_size=14,
        )
    )
    noise_scheduler = diffusers.DDPMScheduler(
        beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False
    )
    for model in (vae, image_encoder):  # as from_pretrained returns them
        model.eval()
    vae.requires_grad_(False)
    image_encoder.requires_grad_(False)
    unet.train()
    args = types.SimpleNamespace(snr_gamma=5.0)
    weight_dtype = torch.float32

    def training_step(batch):
        images = batch["pixel_values"].to(weight_dtype)
        clip_images = batch["clip_pixel_values"].to(weight_dtype)
        latents = vae.encode(images).latents
        image_embeds = image_encoder(clip_images).image_embeds
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()

        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        target = noise

        added_cond_kwargs = {"image_embeds": image_embeds}

        model_pred = unet(
            noisy_latents, timesteps, None, added_cond_kwargs=added_cond_kwargs
        ).sample[:, :4]

        if args.snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack(
                [snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1
            ).min(dim=1)[0]
            if noise_scheduler.config.prediction_type == "epsilon":
                mse_loss_weights = mse_loss_weights / snr
            elif noise_scheduler.config.prediction_type == "v_prediction":
                mse_loss_weights = mse_loss_weights / (snr + 1)

            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()
        return loss

    return types.SimpleNamespace(step=training_step, unet=unet)


def collate_fn(examples):
    """The script's ``collate_fn``, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    clip_pixel_values = torch.stack([example["clip_pixel_values"] for example in examples])
    clip_pixel_values = clip_pixel_values.to(memory_format=torch.contiguous_format).float()
    return {"pixel_values": pixel_values, "clip_pixel_values": clip_pixel_values}


def _example(index: int, resolution: int = 32) -> dict:
    generator = torch.Generator().manual_seed(200 + index)
    return {
        "pixel_values": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
        "clip_pixel_values": torch.randn(3, 28, 28, generator=generator),
    }


@pytest.mark.parametrize("resolution", [32, 48])
def test_kandinsky_decoder_caches_movq_and_image_encoder(resolution):
    parts = build()
    batch = collate_fn([_example(i, resolution) for i in range(2)])
    split = split_and_verify(parts.step, (batch,))
    assert stage2_top_modules(split) == {"unet"}
    assert "self.image_encoder" not in split.stage2.code and "self.vae" not in split.stage2.code


def test_kandinsky_decoder_two_resolutions_round_trip_one_cache(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (collate_fn([_example(0), _example(1)]),))
    batches = [
        collate_fn([_example(i, resolution) for i in (2 * k, 2 * k + 1)])
        for k, resolution in enumerate((32, 48, 32))
    ]
    assert_cache_round_trip(split, parts.step, batches, tmp_path, parts.unet, rows_per_batch=2)
