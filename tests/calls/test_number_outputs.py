"""A frozen call whose output holds Python numbers beside its tensors is cached, exactly.

Wan's VAE encoder (DiffSynth) returns ``(out, feat_cache, feat_idx)`` with ``feat_idx`` a
list holding one int. The plan keeps such numbers as constants: stage 2 hands back the same
number, stage 1 refuses a sample whose call returns another, and a number that differs
between the probe's two runs keeps the call in stage 2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls import Verdict

HIDDEN = 4


class Counting(nn.Module):
    """Returns its features, a cache list and an index list, as Wan's ``Encoder3d`` does."""

    def __init__(self, count: str = "fixed") -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.count, self.calls = count, 0

    def forward(self, x):
        self.calls += 1
        index = {
            "fixed": 3,
            "sample": int((x > 0).sum()),
            "calls": self.calls,
        }[self.count]
        h = self.linear(x)
        return h, [h * 2, None], [index]


class Step(nn.Module):
    def __init__(self, count: str = "fixed") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Counting(count).requires_grad_(False)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h, cache, index = self.encoder(x)
        return self.head(h + cache[0]).square().sum() * index[0]


def test_numbers_in_a_cached_output_are_constants_of_the_plan_and_exact():
    step, x = Step(), torch.randn(1, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    assert [v.verdict for v in split.plan.verdicts] == [Verdict.CACHED]
    assert "encoder" not in {name.split(".")[0] for name, _ in split.stage2.named_parameters()}
    assert all(c.ok for c in graphsplit.verify(step, split, (x,)))
    other = torch.randn(1, HIDDEN)
    assert torch.equal(split.stage2(**split.stage1(other)), step(other))


def test_a_sample_whose_call_returns_another_number_is_refused_by_stage1():
    step = Step("sample")
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    split = graphsplit.split(step, (x,), path="calls")
    split.stage1(x)  # the example's own number
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(torch.ones(1, HIDDEN))
    message = str(caught.value)
    assert "encoder call 0 returned other numbers (or another structure) than on the example" in (
        message
    )
    assert "fix:" in message and "return those numbers as tensors" in message


def test_a_number_that_differs_between_two_runs_keeps_the_call_in_stage2():
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(Step("calls"), (torch.randn(1, HIDDEN),), path="calls")
    message = str(caught.value)
    detail = "(a number in it differs between two runs)"
    assert f"encoder call 0: {Verdict.NON_TENSOR.why} {detail}" in message
