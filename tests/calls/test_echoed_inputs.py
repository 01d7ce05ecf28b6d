"""A cached call that returns the step's own input tensors (sentence-transformers' modules
return the features dict they were given) has those fields answered with the inputs in
stage 2, stored once; stage 1 refuses a batch on which the call returns another tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.helpers import split_and_verify


class Echo(nn.Module):
    """Returns its features with an embedding added, as sentence-transformers' modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.echo = True

    def forward(self, features):
        x = features["x"] if self.echo else features["x"].clone()
        return {"x": x, "mask": features["mask"], "embedding": self.proj(features["x"])}


class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = Echo().requires_grad_(False)
        self.head = nn.Linear(4, 4)

    def forward(self, x, mask, y):
        with torch.no_grad():
            out = self.teacher({"x": x, "mask": mask})
        # The step reads the echoed fields from the teacher's output, not from its inputs.
        student = self.head(out["x"] * out["mask"])
        return F.mse_loss(student, out["embedding"]) + F.mse_loss(student.sum(-1), y)


def _batch(seed: int = 0, size: int = 3):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 4, generator=generator)
    return x, (torch.rand(size, 4, generator=generator) > 0.3).float(), torch.randn(size)


def test_echoed_input_fields_are_answered_with_the_inputs_and_stored_once():
    step = Step()
    split = split_and_verify(step, _batch(), path="calls")
    assert set(split.boundary) == {"x", "mask", "y", "teacher__0__embedding"}
    (planned,) = split.plan.cached.values()
    assert planned.echoed == {"x": "x", "mask": "mask"}
    report = split.report()
    assert "the step's own inputs it returns: x (the input x), mask (the input mask)" in report
    other = _batch(seed=1, size=5)
    assert all(c.ok for c in graphsplit.verify(step, split, other))
    for param in step.parameters():
        param.grad = None
    want = step(*other)
    want.backward()
    grads = [p.grad.clone() for p in step.head.parameters()]
    for param in step.parameters():
        param.grad = None
    got = split.stage2(**split.stage1(*other))
    got.backward()
    assert torch.equal(got, want)
    assert all(torch.equal(p.grad, g) for p, g in zip(step.head.parameters(), grads))


def test_a_batch_on_which_the_call_returns_another_tensor_is_refused_in_stage1():
    step = Step()
    split = split_and_verify(step, _batch(), path="calls")
    step.teacher.echo = False
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(*_batch(seed=1))
    message = str(caught.value)
    assert "teacher call 0 returned the step's input 'x' as its x on the example batch" in message
    assert "fix:" in message
