"""The hand-written split that graphsplit's stage 2 is measured against, and its inputs.

Glossary:
    unsplit step: the zoo's :class:`~tests.zoo.SDLoRAStep` (frozen VAE and CLIP text encoder,
        a LoRA-wrapped UNet) run on raw images and token ids.
    frozen outputs: what a careful user precomputes by hand: the VAE distribution's parameters
        (mean and log-variance, so the latent is still sampled every step) and the text
        embedding. graphsplit's boundary for this step holds the same two tensors.
    hand-written split: the denoiser-only step on the frozen outputs: what graphsplit's stage 2
        should equal in time and memory.

In and out:
    example_batch(size) -> (pixel_values, input_ids)           one batch of the zoo size
    frozen_outputs(step, pixel_values, input_ids) -> {"latent_parameters", "text_embedding"}
    build_unet(size, *, seed) -> (unet, scheduler)             only what the hand-written step needs
    denoising_loss(unet, scheduler, latent_parameters, text_embedding, *, scaling_factor) -> loss
    flux_frozen_outputs(step, pixel_values, t5_ids, clip_ids) -> {"latent_parameters", ...}
    flux_velocity_loss(transformer, latent_parameters, prompt_embeds, pooled, *, ...) -> loss

The models come from ``tests/zoo`` (run from the repository root); torch and diffusers are
imported inside the functions, so the memory benchmark's parent can import this module cheaply.
"""

from __future__ import annotations

from typing import Any

# AutoencoderKL's default latent scaling, which the zoo's VAE configs keep.
SD_SCALING_FACTOR = 0.18215
LORA_RANK = 4  # the zoo's default


def example_batch(size: str) -> tuple[Any, Any]:
    """The first ``batch_size`` captioned images of the zoo ``size``: pixels and token ids."""
    import torch

    from tests.zoo import SD_SIZES, CaptionedImages

    config = SD_SIZES[size]
    dataset = CaptionedImages(length=config.batch_size, resolution=config.resolution)
    items = [dataset[index] for index in range(config.batch_size)]
    pixels = torch.stack([item["pixel_values"] for item in items])
    ids = torch.stack([item["input_ids"] for item in items])
    return pixels, ids


def frozen_outputs(step: Any, pixel_values: Any, input_ids: Any) -> dict[str, Any]:
    """The hand-written split's precomputed inputs, from the step's own frozen modules."""
    import torch

    with torch.no_grad():
        return {
            "latent_parameters": step.vae.encode(pixel_values).latent_dist.parameters,
            "text_embedding": step.text_encoder(input_ids)[0],
        }


def build_unet(size: str, *, seed: int) -> tuple[Any, Any]:
    """Only the LoRA UNet and the scheduler, built from the zoo's config, seed and targets."""
    import torch
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from peft import LoraConfig

    from tests.zoo import SD_SIZES
    from tests.zoo.sd import UNET_LORA_TARGETS

    config = SD_SIZES[size]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 16 + 2)
        unet = UNet2DConditionModel(**config.unet)
    unet.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_RANK,
            init_lora_weights="gaussian",
            target_modules=list(UNET_LORA_TARGETS),
        )
    )
    for name, param in unet.named_parameters():
        param.requires_grad_("lora_" in name)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
    return unet.train(), scheduler


def denoising_loss(
    unet: Any,
    scheduler: Any,
    latent_parameters: Any,
    text_embedding: Any,
    *,
    scaling_factor: float = SD_SCALING_FACTOR,
) -> Any:
    """The denoiser-only step a user writes on the frozen outputs; draws as the zoo step does.

    The random draws come in the unsplit step's order (latent sample, noise, timesteps), so
    from the same seed all three variants draw the same numbers.
    """
    import torch
    import torch.nn.functional as F
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    latents = DiagonalGaussianDistribution(latent_parameters).sample() * scaling_factor
    noise = torch.randn_like(latents)
    timesteps = torch.randint(
        0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
    )
    noisy = scheduler.add_noise(latents, noise, timesteps)
    prediction = unet(noisy, timesteps, text_embedding).sample
    return F.mse_loss(prediction.float(), noise.float())


# -- the Flux mix (benchmarks.bench_plan_scale.FluxLoRAStep) ----------------------------------
def flux_frozen_outputs(step: Any, pixel_values: Any, t5_ids: Any, clip_ids: Any) -> dict:
    """What a careful user precomputes for a Flux LoRA step: the VAE distribution's parameters,
    the T5 sequence embedding and CLIP's pooled embedding."""
    import torch

    with torch.no_grad():
        return {
            "latent_parameters": step.vae.encode(pixel_values).latent_dist.parameters,
            "prompt_embeds": step.text_encoder_2(t5_ids)[0],
            "pooled": step.text_encoder(clip_ids).pooler_output,
        }


def flux_velocity_loss(
    transformer: Any,
    latent_parameters: Any,
    prompt_embeds: Any,
    pooled: Any,
    *,
    shift_factor: float,
    scaling_factor: float,
    guidance_scale: float | None = 3.5,
) -> Any:
    """The DiT-only rectified-flow step on the frozen outputs, drawing as ``FluxLoRAStep`` does
    (latent sample, noise, ``t``), so from one seed it computes the same loss."""
    import torch
    import torch.nn.functional as F
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from benchmarks.bench_plan_scale import FluxLoRAStep

    x0 = DiagonalGaussianDistribution(latent_parameters).sample()
    x0 = (x0 - shift_factor) * scaling_factor
    b, c, h, w = x0.shape
    noise = torch.randn_like(x0)
    t = torch.rand(b, device=x0.device, dtype=x0.dtype)
    x_t = (1 - t.view(b, 1, 1, 1)) * x0 + t.view(b, 1, 1, 1) * noise
    rows = torch.arange(h // 2, device=x0.device, dtype=x0.dtype)[:, None].expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=x0.device, dtype=x0.dtype)[None, :].expand(h // 2, w // 2)
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    txt_ids = torch.zeros((prompt_embeds.shape[1], 3), device=x0.device, dtype=x0.dtype)
    guidance = None
    if guidance_scale is not None:
        guidance = torch.full((b,), guidance_scale, device=x0.device)
    pred = transformer(
        hidden_states=FluxLoRAStep.pack(x_t),
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled,
        timestep=t,
        img_ids=img_ids,
        txt_ids=txt_ids,
        guidance=guidance,
        return_dict=False,
    )[0]
    return F.mse_loss(FluxLoRAStep.unpack(pred, c, h, w).float(), (noise - x0).float())
