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
