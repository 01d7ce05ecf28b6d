"""Conformance: ``examples/t2i_adapter/train_t2i_adapter_sdxl.py``'s training step.

The script precomputes the SDXL prompt embeddings in its dataset (``compute_embeddings``), so
the step gets ``prompt_ids`` (the states) and ``unet_added_conditions`` (a dict of tensors).
Its loop body encodes the pixels with the frozen VAE in chunks of 8 (a Python loop over the
batch), draws timesteps by cubic sampling, and its ``get_sigmas`` finds each timestep's index
with ``(schedule_timesteps == t).nonzero().item()``: a value read of a random draw, which no
traced plan can hold. The whole-step trace refuses it at that line and ``path="auto"`` takes
the module-level path: the frozen VAE's call is cached, the frozen UNet (fed the trainable
adapter's residuals) and the adapter stay in stage 2.
"""

from __future__ import annotations

import types

import pytest
import torch

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")

from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
)


def build(seed: int = 0):
    """``main()``'s models (diffusers' own tiny SDXL-adapter test configs, one layer per
    block) and the loop body."""
    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
        cross_attention_dim=64,
    )
    noise_scheduler = diffusers.EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        beta_schedule="scaled_linear",
        timestep_spacing="leading",
    )
    vae = diffusers.AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        sample_size=128,
    )
    t2iadapter = diffusers.T2IAdapter(
        in_channels=3,
        channels=[32, 64],
        num_res_blocks=2,
        downscale_factor=4,
        adapter_type="full_adapter_xl",
    )
    for model in (vae, unet):  # as from_pretrained returns them
        model.eval()
    vae.requires_grad_(False)
    unet.requires_grad_(False)
    t2iadapter.train()
    args = types.SimpleNamespace(pretrained_vae_model_name_or_path=None)
    weight_dtype = torch.float32
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler.timesteps.to(accelerator.device)
        timesteps = timesteps.to(accelerator.device)

        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def training_step(batch):
        if args.pretrained_vae_model_name_or_path is not None:
            pixel_values = batch["pixel_values"].to(dtype=weight_dtype)
        else:
            pixel_values = batch["pixel_values"]

        # encode pixel values with batch size of at most 8 to avoid OOM
        latents = []
        for i in range(0, pixel_values.shape[0], 8):
            latents.append(vae.encode(pixel_values[i : i + 8]).latent_dist.sample())
        latents = torch.cat(latents, dim=0)
        latents = latents * vae.config.scaling_factor
        if args.pretrained_vae_model_name_or_path is None:
            latents = latents.to(weight_dtype)

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]

        # Cubic sampling to sample a random timestep for each image.
        timesteps = torch.rand((bsz,), device=latents.device)
        timesteps = (1 - timesteps**3) * noise_scheduler.config.num_train_timesteps
        timesteps = timesteps.long().to(noise_scheduler.timesteps.dtype)
        timesteps = timesteps.clamp(0, noise_scheduler.config.num_train_timesteps - 1)

        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        # Scale the noisy latents for the UNet
        sigmas = get_sigmas(timesteps, len(noisy_latents.shape), noisy_latents.dtype)
        inp_noisy_latents = noisy_latents / ((sigmas**2 + 1) ** 0.5)

        # Adapter conditioning.
        t2iadapter_image = batch["conditioning_pixel_values"].to(dtype=weight_dtype)
        down_block_additional_residuals = t2iadapter(t2iadapter_image)
        down_block_additional_residuals = [
            sample.to(dtype=weight_dtype) for sample in down_block_additional_residuals
        ]

        # Predict the noise residual
        model_pred = unet(
            inp_noisy_latents,
            timesteps,
            encoder_hidden_states=batch["prompt_ids"],
            added_cond_kwargs=batch["unet_added_conditions"],
            down_block_additional_residuals=down_block_additional_residuals,
            return_dict=False,
        )[0]

        # Denoise the latents
        denoised_latents = model_pred * (-sigmas) + noisy_latents
        weighing = sigmas**-2.0

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = latents  # we are computing loss against denoise latents
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        # MSE loss
        loss = torch.mean(
            (weighing.float() * (denoised_latents.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            dim=1,
        )
        loss = loss.mean()
        return loss

    return types.SimpleNamespace(step=training_step, adapter=t2iadapter, get_sigmas=get_sigmas)


def _batch(size: int, seed: int = 0, resolution: int = 32) -> dict:
    """The script's ``collate_fn`` output: pixels, conditioning images, precomputed prompts."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.rand(size, 3, resolution, resolution, generator=generator) * 2 - 1,
        "conditioning_pixel_values": torch.rand(
            size, 3, resolution, resolution, generator=generator
        ),
        "prompt_ids": torch.randn(size, 8, 64, generator=generator),
        "unet_added_conditions": {
            "text_embeds": torch.randn(size, 32, generator=generator),
            "time_ids": torch.tensor(
                [[resolution, resolution, 0, 0, resolution, resolution]] * size
            ).float(),
        },
    }


def test_the_trace_refuses_the_schedulers_value_read_of_a_random_draw():
    """``EulerDiscreteScheduler.add_noise`` looks each drawn timestep up with ``nonzero()``."""
    parts = build()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch(2),), path="trace")
    message = str(caught.value)
    assert "EulerDiscreteScheduler.index_for_timestep reads tensor values" in message
    assert "(schedule_timesteps == timestep).nonzero()" in message


def test_auto_caches_the_vae_and_trains_the_adapter_exactly():
    parts = build()
    split = split_and_verify(parts.step, (_batch(2),))
    assert split.path == "calls"
    assert "index_for_timestep" in split.reason
    # Stage 2 holds only what it runs: the frozen UNet and the adapter, not the VAE (its
    # encoder's calls are cached, its decoder never runs in the step).
    assert stage2_top_modules(split) == {"unet", "t2iadapter"}
    assert split.plan.unused == {"vae"}
    assert "not held by stage 2 (the step computes with none of their weights there): vae" in (
        split.report()
    )
    # Only the outermost cached call is stored: the encoder's output goes to quant_conv alone.
    assert "vae_quant_conv__0__out" in split.boundary
    assert not any(key.startswith("vae_encoder") for key in split.boundary)
    encoder = next(v for v in split.plan.verdicts if v.path == "vae.encoder")
    assert encoder.cached
    assert (
        encoder.detail == "not stored: only vae.quant_conv call 0, itself cached, reads its output"
    )
    # The dict of added conditions crosses per key, so every batch's own values train.
    assert {"unet_added_conditions__text_embeds", "unet_added_conditions__time_ids"} <= set(
        split.boundary
    )


def test_t2i_adapter_cache_round_trip(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (_batch(2),))
    batches = [_batch(2, seed) for seed in (1, 2)]
    assert_cache_round_trip(split, parts.step, batches, tmp_path, parts.adapter, rows_per_batch=2)
