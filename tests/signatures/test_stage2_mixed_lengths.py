"""Stage 2 over a cache of padded sequences of several lengths (a collator's
``padding="longest"``): ``graphsplit.collate`` on rows of different lengths refuses, saying why
graphsplit does not pad cached rows and naming the loader that batches by shape; that loader
trains the same cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.errors import CacheError


class Distil(torch.nn.Module):
    """A frozen teacher's states per token, a trainable head: rows as long as the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = torch.nn.Embedding(11, 6).requires_grad_(False)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, ids, target):
        return F.mse_loss(self.head(self.teacher(ids)).squeeze(-1), target)


def _padded(length: int, seed: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 11, (2, length), generator=generator),
        "target": torch.randn(2, length, generator=generator),
        "key": [f"{seed}a", f"{seed}b"],
    }


def test_collate_of_rows_of_two_lengths_refuses_and_names_the_loader(tmp_path):
    step = Distil()
    split = graphsplit.split(step, kwargs={"ids": torch.zeros(2, 3, dtype=torch.long),
                                           "target": torch.zeros(2, 3)})  # fmt: skip
    graphsplit.cache(split, [_padded(3, 0), _padded(5, 1)], tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    plain = DataLoader(cached, batch_size=4, collate_fn=graphsplit.collate)
    with pytest.raises(CacheError) as caught:
        next(iter(plain))
    message = str(caught.value)
    assert "cannot batch 'target': the samples have different shapes: (3,) for '0a', '0b'; " in (
        message
    )
    assert "(5,) for '1a', '1b'. graphsplit does not pad" in message
    assert "graphsplit does not pad cached rows to a batch's longest" in message
    assert "computed at its own batch's padding" in message
    assert 'docs/howto.md, "Datasets of many shapes"' in message
    assert "fix:    batch samples of one shape together: cached.loader(batch_size, seed=0)" in (
        message
    )
    assert "pad the raw data in stage 1 to a multiple (pad_to_multiple_of=...)" in message
    lengths = sorted(batch["target"].shape[1] for batch in cached.loader(batch_size=4, seed=0))
    assert lengths == [3, 5]  # the loader batches by shape: each length a batch of its own
