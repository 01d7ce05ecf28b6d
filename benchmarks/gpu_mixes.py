"""The two model mixes of the GPU benchmark, at full size or tiny, with random weights.

Glossary:
    mix: a training step (frozen encoders feeding a LoRA-wrapped denoiser), its example batch,
        a dataset of random samples for caching, and the hand-written denoiser-only step.
    sd15: Stable Diffusion 1.5's shapes: the SD VAE, a CLIP-L text encoder and the SD-1.5 UNet
        (860M), LoRA rank 16 on the attention projections, batch 8 at 512 px.
    flux: Flux.1's shapes: the Flux VAE, T5-XXL (4.7B, 512 tokens), CLIP-L (pooled) and the
        12B Flux DiT with LoRA rank 16, batch 1 at 1024 px.
    tiny: the same classes with the smallest configs, for ``--dry-run`` on a CPU.

In and out::

    build_mix(name, *, tiny, device, dtype) -> Mix
    Mix.step(**batch) -> loss ; Mix.hand_inputs(batch) -> dict ; Mix.hand_loss(**inputs) -> loss
    RandomSamples(length, ...)[index] -> {"key", "pixel_values", <token ids>...}

Weights are random (default initialisation on the device, then cast to ``dtype``): speed and
memory depend on shapes, not on values. Models are built on the device itself, one component at
a time, so the float32 copy of one component is the largest transient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.bench_plan_scale import (
    CLIP_L,
    FLUX_DIT,
    FLUX_VAE,
    SD_VAE,
    T5_XXL,
    FluxLoRAStep,
    _frozen,
    _lora,
)
from benchmarks.hand_written import (
    denoising_loss,
    flux_frozen_outputs,
    flux_velocity_loss,
    frozen_outputs,
)

MIXES = ("sd15", "flux")

SD15_UNET = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
}
TINY_VOCAB = 1000
TINY_CLIP = {**CLIP_L, "vocab_size": TINY_VOCAB, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "projection_dim": 32,
             "bos_token_id": 998, "eos_token_id": 999, "pad_token_id": 1}  # fmt: skip
TINY_VAE = {**SD_VAE, "block_out_channels": (32, 64), "layers_per_block": 1,
            "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2, "sample_size": 32}  # fmt: skip
FLUX_VAE_CHANGES = ("latent_channels", "scaling_factor", "shift_factor", "use_quant_conv",
                    "use_post_quant_conv")  # fmt: skip
TINY_FLUX_VAE = {**TINY_VAE, **{key: FLUX_VAE[key] for key in FLUX_VAE_CHANGES}}
TINY_UNET = {**SD15_UNET, "sample_size": 16, "block_out_channels": (32, 64),
             "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "layers_per_block": 1,
             "cross_attention_dim": 32}  # fmt: skip
TINY_T5 = {**T5_XXL, "vocab_size": TINY_VOCAB, "d_model": 32, "d_ff": 64, "d_kv": 8,
           "num_layers": 2, "num_heads": 4}  # fmt: skip
TINY_DIT = {**FLUX_DIT, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
            "axes_dims_rope": (4, 6, 6)}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """The batch a mix trains on: images and, per text encoder, (input name, tokens, vocab)."""

    batch_size: int
    resolution: int
    tokens: tuple[tuple[str, int, int], ...]
    samples_to_cache: int


@dataclass
class Mix:
    """A built mix: the step, its shapes and the hand-written split of it."""

    name: str
    step: nn.Module
    shape: Shape
    hand_inputs: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    hand_loss: Callable[..., torch.Tensor]
    denoiser: nn.Module  # the trainable module: all the hand-written step holds

    def dataset(self, dtype: torch.dtype, length: int | None = None) -> RandomSamples:
        return RandomSamples(length or self.shape.samples_to_cache, self.shape, dtype)


class RandomSamples(torch.utils.data.Dataset):
    """Sample ``i``: random pixels in [-1, 1] and random token ids, the same for the same ``i``."""

    def __init__(self, length: int, shape: Shape, dtype: torch.dtype) -> None:
        self.length, self.shape, self.dtype = length, shape, dtype

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(index)
        side = self.shape.resolution
        item: dict[str, Any] = {"key": f"{index:06d}"}
        item["pixel_values"] = (torch.rand(3, side, side, generator=generator) * 2 - 1).to(
            self.dtype
        )
        for name, tokens, vocab in self.shape.tokens:
            item[name] = torch.randint(0, vocab, (tokens,), generator=generator)
        return item


def _on(device: torch.device, dtype: torch.dtype, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device(device):
        module = build()
    return module.to(dtype)


def build_mix(name: str, *, tiny: bool, device: torch.device, dtype: torch.dtype) -> Mix:
    """Build mix ``name`` (``sd15`` or ``flux``) on ``device`` in ``dtype``, seeded."""
    torch.manual_seed(0)
    if name == "sd15":
        return _sd15(tiny, device, dtype)
    if name == "flux":
        return _flux(tiny, device, dtype)
    raise ValueError(f"unknown mix {name!r}; choose from {MIXES}")


def _sd15(tiny: bool, device: torch.device, dtype: torch.dtype) -> Mix:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tests.zoo import SDLoRAStep

    vae_config, clip, unet_config = (TINY_VAE, TINY_CLIP, TINY_UNET) if tiny else (
        SD_VAE, CLIP_L, SD15_UNET)  # fmt: skip
    vae = _frozen(_on(device, dtype, lambda: AutoencoderKL(**vae_config)))
    text = _frozen(_on(device, dtype, lambda: CLIPTextModel(CLIPTextConfig(**clip))))
    unet = _lora(_frozen(_on(device, dtype, lambda: UNet2DConditionModel(**unet_config))))
    unet.to(device=device, dtype=dtype)  # the LoRA weights peft just added
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
    step = SDLoRAStep(vae, text, unet, scheduler)
    shape = Shape(2, 32, (("input_ids", 16, TINY_VOCAB),), 8) if tiny else Shape(
        8, 512, (("input_ids", 77, CLIP_L["vocab_size"]),), 256)  # fmt: skip
    scaling = vae.config.scaling_factor
    return Mix(
        "sd15",
        step,
        shape,
        hand_inputs=lambda batch: frozen_outputs(step, batch["pixel_values"], batch["input_ids"]),
        hand_loss=lambda **inputs: denoising_loss(
            unet, scheduler, **inputs, scaling_factor=scaling
        ),
        denoiser=unet,
    )


def _flux(tiny: bool, device: torch.device, dtype: torch.dtype) -> Mix:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    configs = (TINY_FLUX_VAE, TINY_T5, TINY_CLIP, TINY_DIT) if tiny else (
        FLUX_VAE, T5_XXL, CLIP_L, FLUX_DIT)  # fmt: skip
    vae_config, t5_config, clip_config, dit_config = configs
    vae = _frozen(_on(device, dtype, lambda: AutoencoderKL(**vae_config)))
    t5 = _frozen(_on(device, dtype, lambda: T5EncoderModel(T5Config(**t5_config))))
    clip = _frozen(_on(device, dtype, lambda: CLIPTextModel(CLIPTextConfig(**clip_config))))
    dit = _on(device, dtype, lambda: FluxTransformer2DModel(**dit_config))
    dit = _lora(_frozen(dit)).to(device=device, dtype=dtype)
    step = FluxLoRAStep(vae, t5, clip, dit)
    t5_tokens, clip_vocab = (16, TINY_VOCAB) if tiny else (512, CLIP_L["vocab_size"])
    tokens = (("t5_ids", t5_tokens, t5_config["vocab_size"]), ("clip_ids", 77, clip_vocab))
    shape = Shape(1, 32, tokens, 8) if tiny else Shape(1, 1024, tokens, 64)
    return Mix(
        "flux",
        step,
        shape,
        hand_inputs=lambda batch: flux_frozen_outputs(
            step, batch["pixel_values"], batch["t5_ids"], batch["clip_ids"]
        ),
        hand_loss=lambda **inputs: flux_velocity_loss(
            dit,
            **inputs,
            shift_factor=vae.config.shift_factor,
            scaling_factor=vae.config.scaling_factor,
            guidance_scale=step.guidance_scale,
        ),
        denoiser=dit,
    )
