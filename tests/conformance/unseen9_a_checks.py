"""Tiny SDXL components the unseen-9 (a) conformance steps share, and a check of the boundary.

``sdxl_components`` builds diffusers' own SDXL pipeline-test components
(``tests/pipelines/stable_diffusion_xl/test_stable_diffusion_xl.py``: UNet (2, 4) channels with
``text_time`` added conditions of 6 x 8 + 32, cross-attention 64 = 32 + 32, a (32, 64) VAE, two
CLIP text encoders 32 wide), with one UNet layer a block and two CLIP layers to stay fast, in
eval mode as ``from_pretrained`` returns them. The tokenizers are real word-level
``PreTrainedTokenizerFast`` (no hub download), CLIP's 77 tokens shortened to 12.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from tests.conformance.unseen_checks import word_tokenizer

RESOLUTION = 32


def sdxl_components(vocab_size: int, *, seed: int = 0) -> types.SimpleNamespace:
    import diffusers
    import transformers

    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(2, 4),
        layers_per_block=1,  # 2 in diffusers' test
        time_cond_proj_dim=None,
        sample_size=RESOLUTION,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        # SD2-specific config below
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),  # (1, 2) in diffusers' test
        projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
        cross_attention_dim=64,
        norm_num_groups=1,
    )
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        sample_size=128,
    )
    torch.manual_seed(seed)
    config = transformers.CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=2,
        hidden_size=32,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=2,  # 5 in diffusers' test
        pad_token_id=1,
        vocab_size=vocab_size,
        # SD2-specific config below
        hidden_act="gelu",
        projection_dim=32,
    )
    text_encoder_one = transformers.CLIPTextModel(config)
    text_encoder_two = transformers.CLIPTextModelWithProjection(config)
    for model in (unet, vae, text_encoder_one, text_encoder_two):
        model.eval()  # as from_pretrained returns them
    noise_scheduler = diffusers.DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"
    )
    return types.SimpleNamespace(
        unet=unet,
        vae=vae,
        text_encoder_one=text_encoder_one,
        text_encoder_two=text_encoder_two,
        noise_scheduler=noise_scheduler,
    )


def sdxl_tokenizer(words: list[str]) -> Any:
    tokenizer = word_tokenizer(words)
    tokenizer.model_max_length = 12  # CLIP's 77, shortened
    return tokenizer


def image(index: int, *, channels: int = 3, signed: bool = True) -> torch.Tensor:
    """A transformed image: ``Normalize([0.5], [0.5])`` gives [-1, 1], ``ToTensor`` [0, 1]."""
    generator = torch.Generator().manual_seed(1000 + index)
    values = torch.rand(channels, RESOLUTION, RESOLUTION, generator=generator)
    return values * 2 - 1 if signed else values


def trainable_in_stage2(split: Any) -> set[str]:
    return {n for n, p in split.stage2.named_parameters() if p.requires_grad}


def named_trainable(prefix: str, module: torch.nn.Module) -> set[str]:
    return {f"{prefix}.{n}" for n, p in module.named_parameters() if p.requires_grad}


def stage2_holds(split: Any, prefix: str) -> bool:
    """Whether stage 2 holds any parameter under ``prefix`` (``vae.encoder``...)."""
    return any(name.startswith(prefix) for name, _ in split.stage2.named_parameters())
