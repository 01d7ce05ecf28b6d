"""Tiny components and checks the unseen-11 (b) diffusers conformance steps share.

``sd3_components`` builds diffusers' tiny SD3 test configs (two CLIP text encoders with
projection, a T5 encoder, a (32, 64) VAE with shift and scaling factors, a one-layer
``SD3Transformer2DModel``), as the unseen-2 SD3 DreamBooth test does, in eval mode as
``from_pretrained`` returns them. ``one_thread`` keeps torch at one thread while a test runs
(the suite shares two cores).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch


def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sd3_components(vocab_size: int, *, num_layers: int = 1) -> types.SimpleNamespace:
    import diffusers
    import transformers

    def clip(seed: int) -> Any:
        torch.manual_seed(seed)
        return transformers.CLIPTextModelWithProjection(
            transformers.CLIPTextConfig(
                vocab_size=vocab_size,
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                projection_dim=32,
                max_position_embeddings=77,
                eos_token_id=2,
            )
        )

    text_encoder_one, text_encoder_two = clip(1), clip(2)
    torch.manual_seed(3)
    text_encoder_three = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=vocab_size,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
        )
    )
    torch.manual_seed(4)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=16,
        shift_factor=0.0609,
        scaling_factor=1.5035,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(5)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    for model in (transformer, vae, text_encoder_one, text_encoder_two, text_encoder_three):
        model.eval()  # as from_pretrained returns them
    return types.SimpleNamespace(
        text_encoder_one=text_encoder_one,
        text_encoder_two=text_encoder_two,
        text_encoder_three=text_encoder_three,
        vae=vae,
        transformer=transformer,
    )


def stage2_param_names(split: Any) -> set[str]:
    return {name for name, _ in split.stage2.named_parameters()}


def trainable_names(prefix: str, module: torch.nn.Module) -> set[str]:
    return {f"{prefix}.{n}" for n, p in module.named_parameters() if p.requires_grad}
