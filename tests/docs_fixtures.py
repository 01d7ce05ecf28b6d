"""The objects README and docs snippets assume exist: tiny real models and datasets.

Each docs page may open a snippet with a hidden ``<!-- doctest-setup ... -->`` comment that calls
these, so the visible code stays what a user writes while the suite runs every snippet for real
(tests/test_docs.py). Nothing here is downloaded: configs are tiny, weights random.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from tests.zoo import CaptionedImages, build_sd_lora_step


def text_to_image(samples: int = 4) -> dict[str, Any]:
    """``vae, text_encoder, unet, scheduler``, a batch and a dataset, as the SD LoRA docs use."""
    step = build_sd_lora_step(seed=0)
    dataset = CaptionedImages(length=samples, resolution=32)
    batch = default_collate([dataset[i] for i in range(2)])
    return {
        "step": step,
        "vae": step.vae,
        "text_encoder": step.text_encoder,
        "unet": step.unet,
        "scheduler": step.scheduler,
        "pixel_values": batch["pixel_values"],
        "input_ids": batch["input_ids"],
        "dataset": dataset,
    }


class TwoSizes(Dataset):
    """Captioned images of two sizes, 32x32 then 48x48, ``per_size`` of each in a row: what a
    dataset sorted into aspect-ratio buckets gives, so a ``DataLoader`` of ``per_size`` per
    batch never mixes sizes (the README caches it and trains from one mixed-shape cache)."""

    def __init__(self, per_size: int = 8) -> None:
        self.images = CaptionedImages(length=2 * per_size, resolutions=[32, 48])
        self.order = [*range(0, 2 * per_size, 2), *range(1, 2 * per_size, 2)]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.images[self.order[index]]


def deep_text_encoder() -> torch.nn.Module:
    """A CLIP text encoder with 12 layers (tiny ones), so ``encoder.layers.11`` exists."""
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=1000,
        hidden_size=32,
        num_hidden_layers=12,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        bos_token_id=1,
        eos_token_id=2,
    )
    return CLIPTextModel(config).requires_grad_(False)


class PairsDataset(Dataset):
    """``{"x": (8,), "y": (1,)}`` items for the quick-start step."""

    def __init__(self, length: int = 6) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(length, 8, generator=generator)
        self.y = torch.randn(length, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


def _gpt2(seed: int, hidden: int = 32) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=100, n_positions=32, n_embd=hidden, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def distillation() -> dict[str, Any]:
    """A frozen GPT-2 teacher, a smaller trainable student, a right-padded batch of 2."""
    input_ids = torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0
    return {
        "teacher": _gpt2(1),
        "student": _gpt2(2, hidden=16),
        "input_ids": input_ids,
        "attention_mask": attention_mask,
    }


def vision_language() -> dict[str, Any]:
    """A frozen CLIP vision tower, a linear projector and a GPT-2 language model."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(3)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = CLIPVisionConfig(**sizes, num_attention_heads=4, image_size=32, patch_size=8)
    vision = CLIPVisionModel(config)
    generator = torch.Generator().manual_seed(4)
    return {
        "vit": vision,
        "projector": torch.nn.Linear(32, 32),
        "llm": _gpt2(5),
        "pixel_values": torch.randn(2, 3, 32, 32, generator=generator),
        "input_ids": torch.randint(1, 100, (2, 6), generator=generator),
        "labels": torch.randint(1, 100, (2, 4), generator=generator),
    }


def trainer_distillation() -> dict[str, Any]:
    """A tiny Llama student and teacher and 16 samples padded to one length (docs/howto.md)."""
    from tests.integrations.kd import padded_samples, tiny_llama

    return {
        "student": tiny_llama(1, 16),
        "teacher": tiny_llama(2, 32),
        "train_dataset": padded_samples(16),
    }


def dpo() -> dict[str, Any]:
    """A tiny Qwen2 policy and reference, a word-level tokenizer and 12 preference pairs."""
    from tests.integrations.dpo import preference_pairs, tiny_qwen2, word_tokenizer

    return {
        "policy": tiny_qwen2(1),
        "reference": tiny_qwen2(2),
        "tokenizer": word_tokenizer(),
        "pairs": preference_pairs(12),
    }
