"""A frozen call whose fresh output the step then writes in place is cached, exactly.

DiffSynth's Wan prompt unit does ``prompt_emb = pipe.text_encoder(ids, mask)`` then
``prompt_emb[:, v:] = 0``: the write is the step's own work. Stage 1 keeps the output as the
call returned it, stage 2 hands the step a copy to write into (so the cache stays as written).
An output sharing memory with the call's input stays refused: a copy would not write the input.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls import Verdict

HIDDEN = 4


class WritesItsEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h = self.encoder(x)
        h.mul_(2)  # not idempotent: a cache holding the written value would double it again
        h[:, 1:] = 0
        return self.head(h).square().sum()


class Passing(nn.Module):
    """A frozen module whose output is a view of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN), requires_grad=False)

    def forward(self, x):
        return x[:, :]


class WritesThroughAView(WritesItsEmbedding):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Passing()

    def forward(self, x):
        x = x.clone()
        h = self.encoder(x)
        h.mul_(2)
        return self.head(x).square().sum()


def test_an_output_the_step_writes_in_place_is_cached_as_returned_and_copied_in_stage2():
    step, x = WritesItsEmbedding(), torch.randn(3, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    (verdict,) = split.plan.verdicts
    assert verdict.verdict is Verdict.CACHED and verdict.copied == ("out",)
    assert "the step then writes out in place: stage 2 hands it a copy" in split.report()
    boundary = split.stage1(x)
    # x reaches only the cached call: its shape crosses, not its values
    assert torch.equal(boundary["x__shape"], torch.tensor([[1, HIDDEN]] * 3))
    (key,) = [key for key in boundary if key != "x__shape"]
    assert torch.equal(boundary[key], step.encoder(x))  # as the call returned it
    kept = boundary[key].clone()
    expected = step(x)
    assert torch.equal(split.stage2(**boundary), expected)
    assert torch.equal(boundary[key], kept)  # the step wrote into a copy
    assert torch.equal(split.stage2(**boundary), expected)  # a second epoch reads the same
    assert all(c.ok for c in graphsplit.verify(step, split, (x,)))
    assert "encoder" not in {name.split(".")[0] for name, _ in split.stage2.named_parameters()}


def test_an_output_sharing_memory_with_the_input_that_the_step_writes_stays_refused():
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(WritesThroughAView(), (torch.randn(3, HIDDEN),), path="calls")
    message = str(caught.value)
    assert f"encoder call 0: {Verdict.MUTATED.why}" in message
    assert "mutates out in place, and it shares memory with the call's inputs" in message


def test_two_epochs_over_the_cache_on_disk_give_the_unsplit_loss(tmp_path):
    step = WritesItsEmbedding()
    rows = torch.randn(4, HIDDEN)
    split = graphsplit.split(step, (rows[:2],), path="calls")
    loader = torch.utils.data.DataLoader([{"x": row} for row in rows], batch_size=2)
    graphsplit.cache(split, loader, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache")
    for _ in range(2):  # the step's in-place write must not reach the cached rows
        for first in (0, 2):
            batch = torch.utils.data.default_collate([cached[first], cached[first + 1]])
            assert torch.equal(split.stage2(**batch), step(rows[first : first + 2]))
