"""Shared pieces of the vision-language conformance tests (``test_unseen3_vlm_*.py``).

Nothing can be downloaded, so each test builds the model's own processor from its image
processor (tiny sizes) and a word-level tokenizer made in memory that holds the processor's
special tokens; TRL's ``DataCollatorForVisionLanguageModeling`` then lays each batch out
exactly as ``SFTTrainer`` does (the processor's expanded image tokens, its pixel tensors,
``labels`` -100 on padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

WORDS = [
    "a", "the", "cat", "dog", "sat", "on", "mat", "what", "is", "this", "picture", "of",
    "describe", "it", "red", "blue", "green", "small", "big", "two", "one", "and", "answer", "en",
]  # fmt: skip


def tiny_tokenizer(specials: Sequence[str], **tokens: Any):
    """A ``PreTrainedTokenizerFast`` over ``<pad>``, ``<unk>``, ``specials`` and :data:`WORDS`
    (ids in that order), split on whitespace; ``tokens`` are its named tokens (``bos_token``)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1}
    for token in (*specials, *WORDS):
        vocab.setdefault(token, len(vocab))
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", unk_token="<unk>", **tokens
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    return tokenizer


def images(shapes: Sequence[tuple[int, int]], seed: int = 0) -> list:
    """PIL images of random pixels, ``(height, width)`` each."""
    from PIL import Image

    generator = np.random.default_rng(seed)
    return [
        Image.fromarray(generator.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes
    ]


def random_lora_b(model: nn.Module) -> nn.Module:
    """peft starts ``lora_B`` at zero; random values make every LoRA gradient a real one."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def stage2_paths(split) -> set[str]:
    """Every submodule path stage 2 holds."""
    return {name for name, _ in split.stage2.named_modules() if name}


def stage2_params(split) -> set[str]:
    return {name for name, _ in split.stage2.named_parameters()}
