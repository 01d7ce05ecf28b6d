"""Custom ``torch.autograd.Function`` calls on traced values are one node each.

Traced tensors pass ``isinstance(x, torch.Tensor)``, and torch's ``Function.apply`` handed them
to a C++ helper that takes only real tensors: the trace failed with ``TypeError:
unwrap_if_dead()`` (TRL's fused LM head, ``ChunkedLogProbFunction``, made graphsplit keep a
whole LoRA'd model in stage 2). The call is now recorded as written, so stage 2 runs the
class's own ``backward``: the functions below have a ``backward`` that is deliberately not the
derivative of ``forward``, which a trace through ``forward``'s ops would get wrong.
"""

from __future__ import annotations

import torch
from torch import nn

import graphsplit
from tests.helpers import batch, split_and_verify


class TripledGradient(torch.autograd.Function):
    """Forward doubles; backward triples (not the derivative, on purpose)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class WithUnrequestedOutputs(torch.autograd.Function):
    """Returns ``(y, None)`` like TRL's kernel returns the outputs it was not asked for."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t(), None

    @staticmethod
    def backward(ctx, grad, _unused):
        x, weight = ctx.saved_tensors
        return grad @ weight * 0.5, grad.t() @ x * 0.5


class CustomFunctionAfterFrozenEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 8).requires_grad_(False)
        self.head = nn.Linear(8, 4)
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        hidden = self.head(self.encoder(x))
        projected, extra = WithUnrequestedOutputs.apply(TripledGradient.apply(hidden), self.weight)
        if extra is not None:
            projected = projected + extra
        return projected.square().mean()


def test_a_custom_function_runs_in_stage2_with_its_own_backward():
    torch.manual_seed(0)
    step = CustomFunctionAfterFrozenEncoder()
    x = batch(3, 8)
    split = split_and_verify(step, (x,), path="trace")
    assert set(split.boundary) == {"encoder"}
    assert "TripledGradient_apply(" in split.stage2.code
    assert "WithUnrequestedOutputs_apply(" in split.stage2.code
    # The gradient is the class's backward, not the derivative of its forward.
    step(x).backward()
    custom = step.head.bias.grad.clone()
    step.zero_grad()
    hidden = step.head(step.encoder(x))
    ((hidden * 2) @ step.weight.t()).square().mean().backward()
    assert not torch.allclose(custom, step.head.bias.grad)


class CustomFunctionOnFrozenWork(nn.Module):
    """A custom function on frozen values only: stage 1 runs it; its output is cached."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 8).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(TripledGradient.apply(self.encoder(x))).mean()


def test_a_custom_function_on_frozen_values_is_cached():
    torch.manual_seed(0)
    split = split_and_verify(CustomFunctionOnFrozenWork(), (batch(2, 8),), path="trace")
    assert "TripledGradient_apply" in split.stage1.code
    assert "TripledGradient_apply" not in split.stage2.code


def test_the_trace_leaves_function_apply_as_it_was():
    before = vars(torch.autograd.Function)["apply"]
    graphsplit.split(CustomFunctionOnFrozenWork(), (batch(2, 8),), path="trace")
    assert vars(torch.autograd.Function)["apply"] is before
    assert "apply" not in vars(TripledGradient)
