"""Stage 2 reads a size or device off a boundary tensor instead of a frozen output it lacks.

OPT and BART build their mask from ``inputs_embeds.shape`` / ``.device``, where
``inputs_embeds`` is a frozen embedding's output that is not on the boundary (``inputs_embeds +
positions`` is). The mask used to stay a stored constant with its length guarded: a plan per
padded length. Stage 2 now makes the read on a boundary tensor computed from it (its twin), and
stage 1 checks on every batch that both give the same value
(graphsplit/planning/cut/twin_reads.py): one plan for every length, and a batch where the two
differ gets a plan of its own instead of a wrong mask.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.runtime import PlanMismatch
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.helpers import split_and_verify


class MaskFromTheEmbeddingsSize(nn.Module):
    """OPT in miniature: the causal mask is made from the frozen embeddings' length and
    device; the boundary carries embeddings + positions."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.positions = nn.Embedding(32, 8).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, ids, mask):
        embeds = self.tokens(ids)
        hidden = embeds + self.positions(mask.cumsum(1))
        n = embeds.shape[1]
        rows = torch.arange(n, device=embeds.device)
        causal = rows[:, None] >= rows[None, :]  # a constant per length
        scores = (hidden * self.scale) @ hidden.transpose(1, 2)
        return scores.masked_fill(~causal, 0.0).mean()


class LengthOffAProjection(MaskFromTheEmbeddingsSize):
    """The boundary tensor has another width (OPT-350m's ``project_in``): only the length,
    ``embeds.shape[1]``, can be read off it, not the whole shape."""

    def __init__(self) -> None:
        super().__init__()
        self.project_in = nn.Linear(8, 4).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, ids, mask):
        embeds = self.tokens(ids)
        hidden = self.project_in(embeds)
        rows = torch.arange(embeds.shape[1])
        causal = rows[:, None] >= rows[None, :]
        scores = (hidden * self.scale) @ hidden.transpose(1, 2)
        return scores.masked_fill(~causal, 0.0).mean()


class TruncatedTwin(MaskFromTheEmbeddingsSize):
    """The boundary tensor keeps the first four positions: at length 4 its shape is the
    embeddings', at any other length it is not."""

    def forward(self, ids, mask):
        embeds = self.tokens(ids)
        hidden = (embeds + self.positions(mask.cumsum(1)))[:, :4]
        rows = torch.arange(embeds.shape[1], device=embeds.device)
        causal = (rows[:, None] >= rows[None, :])[:4, :4]
        scores = (hidden * self.scale) @ hidden.transpose(1, 2)
        return scores.masked_fill(~causal, 0.0).mean()


def _batch(length: int, size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 16, (size, length), generator=torch.Generator().manual_seed(length))
    return ids, torch.ones(size, length, dtype=torch.long)


def test_the_mask_is_made_in_stage2_from_the_boundarys_length_one_plan():
    torch.manual_seed(0)
    step = MaskFromTheEmbeddingsSize()
    split = split_and_verify(step, _batch(5))
    assert not [key for key, spec in split.boundary.items() if spec.is_constant]
    assert "self.tokens" not in split.stage2.code  # stage 2 never runs the frozen embedding
    assert "add.shape" in split.stage2.code and "add.device" in split.stage2.code
    assert "check_same_read" in split.stage1.code  # stage 1 checks both reads per batch
    report = split.report()
    listed = report.split("Sizes stage 2 reads off a cached tensor")[1].split("\n\n")[0]
    assert "tokens.shape" in listed and "tokens.device" in listed and "read off add" in listed
    for length in (7, 3, 12):
        assert all(c.ok for c in graphsplit.verify(step, split, _batch(length, 3), seed=length))
    assert len(split.plans) == 1


def test_one_entry_of_the_shape_is_read_when_the_whole_shape_differs():
    torch.manual_seed(0)
    step = LengthOffAProjection()
    split = split_and_verify(step, _batch(5))
    assert not [key for key, spec in split.boundary.items() if spec.is_constant]
    code = split.stage2.code
    assert "tokens_shape = project_in.shape\n    tokens_shape_1 = tokens_shape[1]" in code, code
    for length in (7, 3):
        assert all(c.ok for c in graphsplit.verify(step, split, _batch(length), seed=length))
    assert len(split.plans) == 1


def test_a_batch_where_the_twin_differs_gets_a_plan_of_its_own():
    torch.manual_seed(0)
    step = TruncatedTwin()
    split = split_and_verify(step, _batch(4))
    first = split.plans[0]
    with pytest.raises(PlanMismatch) as refusal:  # the plan's own stage 1, undispatched
        type(first.stage1).forward(first.stage1, *_batch(6))
    message = str(refusal.value)
    assert "this plan reads tokens.shape off" in message, message
    assert "test_twin_reads.py" in message and "embeds.shape[1]" in message, message
    assert refusal.value.difference is not None
    assert refusal.value.difference.what == "tokens.shape"
    assert all(c.ok for c in graphsplit.verify(step, split, _batch(6), seed=1))
    assert len(split.plans) == 2  # the constant of length 6 is stored and guarded there
    assert all(c.ok for c in graphsplit.verify(step, split, _batch(4, 3), seed=2))
    assert len(split.plans) == 2


def test_a_cache_of_many_lengths_under_one_plan_trains_exactly(tmp_path):
    torch.manual_seed(0)
    step = MaskFromTheEmbeddingsSize()
    split = graphsplit.split(step, _batch(5))
    raw = []
    for length in (5, 9, 3, 6):
        ids, mask = _batch(length)
        raw.append({"ids": ids, "mask": mask, "key": [f"{length}a", f"{length}b"]})

    def eager(batch):
        return step(batch["ids"], batch["mask"])

    assert_cache_round_trip(split, eager, raw, tmp_path / "cache", [step.scale])
    assert len(split.plans) == 1


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=4))
def test_any_lengths_are_exact_under_the_first_plan(lengths):
    torch.manual_seed(0)
    step = MaskFromTheEmbeddingsSize()
    split = graphsplit.split(step, _batch(5))
    for seed, length in enumerate(lengths):
        checks = graphsplit.verify(step, split, _batch(length, 1 + seed % 3), seed=seed)
        assert checks and all(c.ok for c in checks)
    assert len(split.plans) == 1
