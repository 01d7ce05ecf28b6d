"""Real diffusers / transformers / peft training steps with tiny configs and random weights.

The library is about real training code, so its tests must run the classes users run (an
``AutoencoderKL`` whose ``encode`` returns a distribution, a ``CLIPTextModel``, a peft-LoRA
``UNet2DConditionModel``, a ``DDPMScheduler`` that branches on shapes), not look-alikes. The
configs are small enough that a step runs in well under a second on two CPU cores.

Each component is built from its own seed (derived from ``seed``), inside a forked RNG, so a
component's weights do not depend on whether the others were built on ``meta`` and building a
step does not disturb the caller's random stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel

from tests.zoo.data import special_token_ids

__all__ = [
    "SD_SIZES",
    "CLIPPartialLoRAStep",
    "SDLoRAStep",
    "SDSize",
    "TextualInversionStep",
    "build_frozen_sd",
    "build_partial_encoder_lora_step",
    "build_sd_lora_step",
    "build_textual_inversion_step",
]

UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
VOCAB_SIZE = 1000


@dataclass(frozen=True)
class SDSize:
    """One model size: constructor kwargs per component plus the data shape it is meant for."""

    vae: dict[str, Any]
    text: dict[str, Any]
    unet: dict[str, Any]
    resolution: int
    batch_size: int = 2
    max_tokens: int = 16
    notes: str = field(default="", compare=False)


def _vae(channels: tuple[int, ...], layers: int = 1, groups: int = 32) -> dict[str, Any]:
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * len(channels),
        "up_block_types": ("UpDecoderBlock2D",) * len(channels),
        "block_out_channels": channels,
        "layers_per_block": layers,
        "latent_channels": 4,
        "norm_num_groups": groups,
    }


def _text(hidden: int, layers: int, heads: int, intermediate: int) -> dict[str, Any]:
    bos, eos, pad = special_token_ids(VOCAB_SIZE)
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": 77,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def _unet(
    channels: tuple[int, ...], cross_dim: int, sample: int, layers: int = 1
) -> dict[str, Any]:
    n = len(channels)
    return {
        "sample_size": sample,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": channels,
        "layers_per_block": layers,
        "down_block_types": ("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        "cross_attention_dim": cross_dim,
        "attention_head_dim": 8,
        "norm_num_groups": 32,
    }


SD_SIZES: dict[str, SDSize] = {
    "tiny": SDSize(
        vae=_vae((32, 64)),
        text=_text(32, 2, 4, 64),
        unet=_unet((32, 64), 32, 16),
        resolution=32,
        notes="unit tests: batch 2 at 32 px",
    ),
    "small": SDSize(
        vae=_vae((32, 32, 64, 64)),
        text=_text(64, 4, 4, 128),
        unet=_unet((64, 128, 128), 64, 16, layers=2),
        resolution=128,
        batch_size=4,
        notes="benchmarks: a realistic frozen/trainable balance at 128 px",
    ),
    "heavy_frozen": SDSize(
        vae=_vae((64, 128, 128, 128), layers=2),
        text=_text(256, 8, 8, 1024),
        unet=_unet((32, 64), 256, 16),
        resolution=128,
        batch_size=4,
        notes="benchmarks: frozen VAE + text encoder dominate the step",
    ),
}


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run a block from a fixed CPU RNG state without changing the caller's state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _component_seed(seed: int, index: int) -> int:
    return seed * 16 + index


def _device_ctx(on_meta: bool) -> Any:
    return torch.device("meta") if on_meta else nullcontext()


def _frozen(module: nn.Module) -> nn.Module:
    """Freeze and put in eval mode: the way training scripts hold VAE and text encoder."""
    module.requires_grad_(False)
    return module.eval()


def _only_lora_trainable(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)


def _randomize_lora_b(module: nn.Module, std: float = 0.02) -> None:
    """Give ``lora_B`` small random values instead of peft's zeros.

    With ``lora_B == 0`` every ``lora_A`` gradient is exactly zero, so a test comparing split
    and unsplit gradients would compare zeros with zeros. Random B makes all of them real.
    """
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, std)


def _lora_config(rank: int, targets: Any) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets)


def _build_vae(size: SDSize, seed: int, on_meta: bool) -> AutoencoderKL:
    with _seeded(_component_seed(seed, 0)), _device_ctx(on_meta):
        vae = AutoencoderKL(sample_size=size.resolution, **size.vae)
    return _frozen(vae)


def _build_text_encoder(text_kwargs: dict[str, Any], seed: int, on_meta: bool) -> CLIPTextModel:
    config = CLIPTextConfig(**text_kwargs)
    with _seeded(_component_seed(seed, 1)), _device_ctx(on_meta):
        text_encoder = CLIPTextModel(config)
    return _frozen(text_encoder)


def _build_unet(size: SDSize, seed: int, on_meta: bool) -> UNet2DConditionModel:
    with _seeded(_component_seed(seed, 2)), _device_ctx(on_meta):
        unet = UNet2DConditionModel(**size.unet)
    return _frozen(unet)


def _build_scheduler() -> DDPMScheduler:
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")


def _size(size: str) -> SDSize:
    try:
        return SD_SIZES[size]
    except KeyError:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SD_SIZES)}") from None


class SDLoRAStep(nn.Module):
    """A Stable-Diffusion LoRA training step, written the way users write it.

    ``forward(pixel_values, input_ids)`` returns the scalar denoising loss. Frozen VAE and text
    encoder feed a LoRA-wrapped UNet; noise and timesteps are drawn inside the step.
    """

    def __init__(
        self,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModel,
        unet: UNet2DConditionModel,
        scheduler: DDPMScheduler,
    ) -> None:
        super().__init__()
        self.vae = vae
        self.text_encoder = text_encoder
        self.unet = unet
        self.scheduler = scheduler

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        latents = (
            self.vae.encode(pixel_values).latent_dist.sample() * self.vae.config.scaling_factor
        )
        encoder_hidden_states = self.text_encoder(input_ids)[0]
        noise = torch.randn_like(latents)
        timesteps = torch.randint(
            0,
            self.scheduler.config.num_train_timesteps,
            (latents.shape[0],),
            device=latents.device,
        )
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        pred = self.unet(noisy, timesteps, encoder_hidden_states).sample
        return torch.nn.functional.mse_loss(pred.float(), noise.float())


def build_sd_lora_step(
    *,
    seed: int = 0,
    lora_rank: int = 4,
    gradient_checkpointing: bool = False,
    frozen_on_meta: bool = False,
    trainable_on_meta: bool = False,
    size: str = "tiny",
) -> SDLoRAStep:
    """Build an :class:`SDLoRAStep`; only the UNet's ``lora_A`` / ``lora_B`` weights train.

    ``frozen_on_meta`` builds VAE and text encoder on ``meta`` (a stage-2 process never needs
    their weights); ``trainable_on_meta`` does the same for the LoRA UNet (stage 1 never needs
    it). ``size`` is a key of :data:`SD_SIZES`; its ``resolution`` is the intended image side.
    """
    spec = _size(size)
    vae = _build_vae(spec, seed, frozen_on_meta)
    text_encoder = _build_text_encoder(spec.text, seed, frozen_on_meta)
    unet = _build_unet(spec, seed, trainable_on_meta)
    with _seeded(_component_seed(seed, 3)), _device_ctx(trainable_on_meta):
        # diffusers' own add_adapter, as in its train_text_to_image_lora.py example.
        unet.add_adapter(_lora_config(lora_rank, list(UNET_LORA_TARGETS)))
        _randomize_lora_b(unet)
    _only_lora_trainable(unet)
    unet.train()
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return SDLoRAStep(vae, text_encoder, unet, _build_scheduler())


def build_frozen_sd(
    *, seed: int = 0, size: str = "tiny"
) -> tuple[AutoencoderKL, CLIPTextModel, UNet2DConditionModel, DDPMScheduler]:
    """``(vae, text_encoder, unet, scheduler)``, all frozen and in eval mode (no adapter).

    For steps that train something next to the UNet (a ControlNet, an adapter) rather than
    inside it; the same seeds as :func:`build_sd_lora_step`, so the weights match.
    """
    spec = _size(size)
    vae = _build_vae(spec, seed, on_meta=False)
    text_encoder = _build_text_encoder(spec.text, seed, on_meta=False)
    unet = _build_unet(spec, seed, on_meta=False)
    return vae, text_encoder, unet, _build_scheduler()


class CLIPPartialLoRAStep(nn.Module):
    """A frozen CLIP text encoder with LoRA on its last layers only, plus a trainable head.

    The first layers see no trainable weight, so their output is cacheable: the case of caching
    *inside* an encoder. ``forward(input_ids, target)`` regresses the pooled (EOS) state,
    projected by ``head``, onto ``target`` of shape ``(batch, head.out_features)``.
    """

    def __init__(self, text_encoder: CLIPTextModel, head: nn.Linear) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.head = head

    def forward(self, input_ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pooled = self.text_encoder(input_ids).pooler_output
        return F.mse_loss(self.head(pooled), target)


def build_partial_encoder_lora_step(
    seed: int = 0, *, lora_rank: int = 4, out_features: int = 8
) -> CLIPPartialLoRAStep:
    """Build a :class:`CLIPPartialLoRAStep`: 4 frozen layers, LoRA on q/v of layers 2 and 3."""
    text_encoder = _build_text_encoder(_text(32, 4, 4, 64), seed, on_meta=False)
    targets = r".*encoder\.layers\.(2|3)\.self_attn\.(q_proj|v_proj)"
    with _seeded(_component_seed(seed, 3)):
        # transformers 5.x's own add_adapter refuses peft 0.21; peft's injector works.
        inject_adapter_in_model(_lora_config(lora_rank, targets), text_encoder)
        _randomize_lora_b(text_encoder)
        head = nn.Linear(text_encoder.config.hidden_size, out_features)
    _only_lora_trainable(text_encoder)
    return CLIPPartialLoRAStep(text_encoder, head)


def causal_mask(hidden_states: torch.Tensor) -> torch.Tensor:
    """Additive ``(1, 1, seq, seq)`` causal mask, as ``CLIPTextModel.forward`` would apply.

    transformers 5.x builds it with ``create_causal_mask``, which for SDPA returns ``None`` and
    passes ``is_causal=True`` down instead (``CLIPAttention.is_causal`` itself is False). An
    explicit mask is correct for every attention backend and is a shape-only computation.
    """
    seq = hidden_states.shape[1]
    dtype = hidden_states.dtype
    full = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=hidden_states.device)
    return torch.triu(full, diagonal=1)[None, None]


class TextualInversionStep(nn.Module):
    """Textual inversion: only ``new_embeddings`` (rows for placeholder tokens) train.

    Ids ``>= vocab_size`` in ``input_ids`` select rows of ``new_embeddings``; all others go
    through the frozen token table. Because a trainable tensor enters the text encoder at its
    input, the encoder cannot be cached; the VAE side still can.
    """

    def __init__(
        self,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModel,
        unet: UNet2DConditionModel,
        scheduler: DDPMScheduler,
        new_embeddings: torch.Tensor,
    ) -> None:
        super().__init__()
        self.vae = vae
        self.text_encoder = text_encoder
        self.unet = unet
        self.scheduler = scheduler
        self.vocab_size = int(text_encoder.config.vocab_size)
        self.new_embeddings = nn.Parameter(new_embeddings)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings with placeholders swapped in (no control flow on tensor values)."""
        n_new = self.new_embeddings.shape[0]
        is_new = (input_ids >= self.vocab_size).unsqueeze(-1)
        base_ids = input_ids.clamp(max=self.vocab_size - 1)
        new_ids = (input_ids - self.vocab_size).clamp(min=0, max=n_new - 1)
        base = self.text_encoder.embeddings.token_embedding(base_ids)
        new = F.embedding(new_ids, self.new_embeddings)
        return torch.where(is_new, new, base)

    def encode_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``CLIPTextModel(input_ids).last_hidden_state``, but from embeddings we built."""
        hidden = self.text_encoder.embeddings(inputs_embeds=self.embed_tokens(input_ids))
        hidden = self.text_encoder.encoder(
            inputs_embeds=hidden, attention_mask=causal_mask(hidden)
        ).last_hidden_state
        return self.text_encoder.final_layer_norm(hidden)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        latents = (
            self.vae.encode(pixel_values).latent_dist.sample() * self.vae.config.scaling_factor
        )
        encoder_hidden_states = self.encode_text(input_ids)
        noise = torch.randn_like(latents)
        timesteps = torch.randint(
            0,
            self.scheduler.config.num_train_timesteps,
            (latents.shape[0],),
            device=latents.device,
        )
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        pred = self.unet(noisy, timesteps, encoder_hidden_states).sample
        return F.mse_loss(pred.float(), noise.float())


def build_textual_inversion_step(
    seed: int = 0, *, n_new_tokens: int = 2, size: str = "tiny"
) -> TextualInversionStep:
    """Build a :class:`TextualInversionStep`; placeholder ids are ``VOCAB_SIZE + k``.

    The new rows start as copies of existing token rows (the usual "initializer token"), so the
    step behaves like the base model until trained.
    """
    spec = _size(size)
    vae = _build_vae(spec, seed, on_meta=False)
    text_encoder = _build_text_encoder(spec.text, seed, on_meta=False)
    unet = _build_unet(spec, seed, on_meta=False)
    init_ids = torch.arange(1, n_new_tokens + 1)
    rows = text_encoder.embeddings.token_embedding.weight.detach()[init_ids].clone()
    return TextualInversionStep(vae, text_encoder, unet.train(), _build_scheduler(), rows)
