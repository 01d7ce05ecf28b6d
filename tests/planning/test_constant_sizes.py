"""A per-dataset constant made from a batch size is one tensor per plan.

``torch.arange(x.shape[1])`` reads no value of the batch, so it is a per-dataset constant,
stored once per plan; the length flowed through torch ops only, so one plan served batches of
two lengths and ``cache()`` stopped at the second one: "the per-dataset constant differs
between batches of one plan" (transformers' Llama builds its ``position_ids`` and causal mask
so). The size is now a guard: each length gets a plan, and its constants, of its own.
"""

from __future__ import annotations

import torch
from torch import nn

import graphsplit
from tests.helpers import split_and_verify


class PositionsFromTheLength(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.positions = nn.Embedding(32, 8).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        positions = self.positions(torch.arange(ids.shape[1]))  # a constant per length
        return self.head(self.tokens(ids) * self.scale + positions).mean()


def _ids(size: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (size, length), generator=torch.Generator().manual_seed(seed))


def test_each_length_gets_a_plan_and_constants_of_its_own(tmp_path):
    torch.manual_seed(0)
    step = PositionsFromTheLength()
    short, long = _ids(2, 5), _ids(2, 7, seed=1)
    split = split_and_verify(step, (short,))
    constants = [key for key, spec in split.boundary.items() if spec.is_constant]
    assert constants and split.boundary[constants[0]].shape[0] == 5
    assert all(c.ok for c in graphsplit.verify(step, split, (long,)))
    assert len(split.plans) == 2
    assert "ids.shape[1]" in str(split.signatures[0])
    assert any("torch.arange(ids.shape[1])" in line for _, line in split.signatures[0].lines)

    loader = [{"ids": short, "key": ["a", "b"]}, {"ids": long, "key": ["c", "d"]}]
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    dataset = graphsplit.CachedDataset(tmp_path / "cache", split=split)
    for rows, ids in ((range(2), short), (range(2, 4), long)):
        cached = graphsplit.collate([dataset[index] for index in rows])
        assert torch.equal(split.stage2(**cached), step(ids))


class PositionsFromTheBatchSize(nn.Module):
    """A constant never follows the batch size: nothing is guarded for ``x.shape[0]``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 8).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        rows = x.shape[0]
        bias = self.table(torch.arange(4)).sum(0) * 0 + rows * 0  # reads the batch size
        return self.head(x + bias).mean()


def test_the_batch_size_is_not_made_a_guard():
    torch.manual_seed(0)
    step = PositionsFromTheBatchSize()
    split = split_and_verify(step, (torch.randn(2, 8),))
    assert all(c.ok for c in graphsplit.verify(step, split, (torch.randn(3, 8),)))
    assert len(split.plans) == 1
    assert "shape[0]" not in str(split.signatures[0])


class _SinusoidalTable(nn.Embedding):
    """Pegasus's and Marian's positions in miniature: called on a shape, it slices itself."""

    def forward(self, shape):
        return super().forward(torch.arange(shape[1], device=self.weight.device))


class PositionsFromAShapeGivenWhole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.positions = _SinusoidalTable(32, 8).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        embeds = self.tokens(ids) * 2.0
        positions = self.positions(embeds.shape[:-1])  # a torch.Size (batch, length)
        return self.head(embeds * self.scale + positions).mean()


def test_a_shape_given_whole_to_a_frozen_module_guards_its_length_not_the_batch(tmp_path):
    """The constant's length is no int of the graph: the entries of the ``torch.Size`` are
    guarded, the batch size's left out (it used to be one plan whose constant had two shapes,
    and ``cache()`` stopped at the second length)."""
    torch.manual_seed(0)
    step = PositionsFromAShapeGivenWhole()
    short, long = _ids(2, 5), _ids(2, 7, seed=1)
    split = split_and_verify(step, (short,))
    assert all(c.ok for c in graphsplit.verify(step, split, (_ids(3, 5, seed=2),)))
    assert len(split.plans) == 1  # another batch size: no plan of its own
    assert all(c.ok for c in graphsplit.verify(step, split, (long,)))
    assert len(split.plans) == 2
    assert "shape[:-1][1]" in str(split.signatures[0]), split.signatures[0]
    loader = [{"ids": short, "key": ["a", "b"]}, {"ids": long, "key": ["c", "d"]}]
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    dataset = graphsplit.CachedDataset(tmp_path / "cache", split=split)
    for rows, ids in ((range(2), short), (range(2, 4), long)):
        cached = graphsplit.collate([dataset[index] for index in rows])
        assert torch.equal(split.stage2(**cached), step(ids))
