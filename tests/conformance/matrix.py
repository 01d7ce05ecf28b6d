"""Shared pieces of the conformance matrix: what stage 2 holds, tiny token batches.

The steps themselves live in the test modules, each written as its library's own training
script writes it; only the checks every case repeats live here.
"""

from __future__ import annotations

import torch

import graphsplit


def stage2_modules(split: graphsplit.Split) -> set[str]:
    """Top-level submodules of the step that stage 2 holds (its frozen encoders must not be)."""
    return {name.split(".")[0] for name, _ in split.stage2.named_modules() if name}


def ids_and_mask(
    size: int, tokens: int = 8, vocab: int = 64, seed: int = 0, pad: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and an attention mask with ``pad`` right-padding tokens on sample 0."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, tokens), generator=generator)
    mask = torch.ones(size, tokens, dtype=torch.long)
    mask[0, tokens - pad :] = 0
    return ids, mask
