"""Stage 2 rechecks the Python ints the trace read (issue 11: guards rechecked at run time)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.errors import SplitError
from graphsplit.runtime import check_size
from tests.helpers import batch, frozen, line_of, split_and_verify


class PositionTable(nn.Module):
    """A DiT that reads its token grid as Python ints and slices a position table with them."""

    def __init__(self) -> None:
        super().__init__()
        self.vae = frozen(nn.Conv2d(3, 4, 2, stride=2))
        self.patch = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4, 4)
        self.positions = torch.randn(256, 4)

    def forward(self, pixels):
        latents = self.patch(self.vae(pixels))
        height, width = int(latents.shape[2]), int(latents.shape[3])
        tokens = latents.flatten(2).transpose(1, 2)
        tokens = tokens + self.positions[torch.arange(height * width)]
        return self.head(tokens).mean()


class PositionList(PositionTable):
    """The same grid read as Python ints by ``range``: the plan holds the number it read."""

    def forward(self, pixels):
        latents = self.patch(self.vae(pixels))
        height, width = latents.shape[2], latents.shape[3]
        tokens = latents.flatten(2).transpose(1, 2)
        tokens = tokens + self.positions[list(range(height * width))]
        return self.head(tokens).mean()


def test_a_plan_fed_another_resolution_names_the_size_the_line_and_the_fix():
    model = PositionList()
    split = split_and_verify(model, (batch(2, 3, 16, 16),))
    split.plan_set.max_plans = 1  # another resolution is refused, not given a plan of its own
    assert split.stage2.code.count("graphsplit_runtime_check_size(") == 1
    other = batch(2, 3, 16, 8, seed=1)
    with pytest.raises(SplitError) as caught:
        split.stage2(**split.stage1(other))
    message = str(caught.value)
    made_for = "this plan was made for patch.shape[2] * patch.shape[3] = 64, got 32: the batch"
    assert made_for in message
    assert line_of(PositionList.forward, "list(range(height * width))") in message
    assert "fix:    pass a larger max_plans to graphsplit.split" in message


def test_int_of_the_grid_stays_traced_and_one_plan_serves_every_resolution():
    """``int()`` of a size is the size, traced (planning/tracing/int_calls.py): no check."""
    model = PositionTable()
    split = split_and_verify(model, (batch(2, 3, 16, 16),))
    assert "check_size" not in split.stage2.code + split.stage1.code
    other = batch(2, 3, 16, 8, seed=1)
    torch.manual_seed(0)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))
    assert len(split.plans) == 1


def test_the_checks_pass_at_the_size_the_plan_was_made_for():
    model = PositionTable()
    split = graphsplit.split(model, (batch(2, 3, 16, 16),))
    other = batch(5, 3, 16, 16, seed=2)  # another batch size is fine: only sizes are baked
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


def test_sizes_the_plan_keeps_traced_are_not_checked():
    class Traced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vae = frozen(nn.Conv2d(3, 4, 1))
            self.head = nn.Linear(4, 1)

        def forward(self, pixels):
            latents = self.vae(pixels)
            return self.head(latents.flatten(2).transpose(1, 2)).mean()

    split = split_and_verify(Traced(), (batch(2, 3, 4, 4),))
    assert "check_size" not in split.stage2.code


def test_check_size_reads_ints_and_tensor_lengths():
    assert check_size(8, 8, "x.shape[2]", "step.py:3") == 8
    assert check_size(torch.zeros(3, 2), 3, "len(x)", "step.py:3").shape == (3, 2)
    with pytest.raises(SplitError, match=r"made for len\(x\) = 4, got 3"):
        check_size(torch.zeros(3, 2), 4, "len(x)", "step.py:3")
