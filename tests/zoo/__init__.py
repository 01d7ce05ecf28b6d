"""Real-model training steps for tests, demos and benchmarks (the optional ``hf`` extra).

Tiny diffusers / transformers / peft models with random weights, so the library is exercised
on the classes users actually train (a VAE that returns a distribution, a CLIP text encoder, a
LoRA UNet, a shape-branching scheduler) without downloads. Importing this package needs
diffusers, transformers and peft; nothing else in graphsplit imports it.
"""

from tests.zoo.data import CaptionedImages, special_token_ids, tokenize
from tests.zoo.sd import (
    SD_SIZES,
    CLIPPartialLoRAStep,
    SDLoRAStep,
    SDSize,
    TextualInversionStep,
    build_frozen_sd,
    build_partial_encoder_lora_step,
    build_sd_lora_step,
    build_textual_inversion_step,
)

__all__ = [
    "SD_SIZES",
    "CLIPPartialLoRAStep",
    "CaptionedImages",
    "SDLoRAStep",
    "SDSize",
    "TextualInversionStep",
    "build_frozen_sd",
    "build_partial_encoder_lora_step",
    "build_sd_lora_step",
    "build_textual_inversion_step",
    "special_token_ids",
    "tokenize",
]
