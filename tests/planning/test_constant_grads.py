"""A tensor made outside the step that still carries a gradient to a parameter
(graphsplit/planning/analyse/constant_grads.py).

diffusers' Kandinsky 2.2 prior script normalises with ``clip_mean = prior.clip_mean.clone()``,
a clone of a trainable parameter the step reads from its closure. The trace holds it as a
constant; taken for data, the work on it looked frozen: under the step's ``no_grad`` stage 2
sent gradients eager never sends, and a product with it was cached, losing the gradient eager
sends through it. Each step below would train wrong if that work were cached or moved.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.planning.analyse.constant_grads import HELD_GRAD_FIX
from tests.helpers import line_of, split_and_verify


def _parts():
    torch.manual_seed(0)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    trained = nn.Linear(4, 4)
    return frozen, trained, torch.randn(3, 4)


def test_a_clone_of_a_trainable_parameter_under_no_grad_is_refused_by_the_trace():
    frozen, trained, x = _parts()
    snapshot = trained.bias.clone()  # as clip_mean = prior.clip_mean.clone()

    def step(x):
        with torch.no_grad():
            target = frozen(x) - snapshot
        return F.mse_loss(trained(x), target)

    with pytest.raises(graphsplit.TraceError) as refusal:
        graphsplit.split(step, (x,), path="trace")
    message = str(refusal.value)
    assert "depends on trainable parameters (trained.bias)" in message
    assert line_of(step, "target = frozen(x) - snapshot") in message
    split = graphsplit.split(step, (x,))  # path="auto": the module-level path, exact
    checks = graphsplit.verify(step, split, (x,))
    assert checks and all(check.ok for check in checks)


def test_a_product_with_a_clone_stays_in_stage2_with_its_gradient():
    frozen, trained, x = _parts()
    snapshot = trained.bias.clone()

    def step(x):
        return F.mse_loss(trained(x), frozen(x) * snapshot)

    split = split_and_verify(step, (x,), path="trace")
    assert "frozen" in split.boundary  # the frozen call alone is cached
    assert not [key for key in split.boundary if key.startswith("mul")]
    # Through a cache (stage 1's outputs detached) the bias still gets eager's gradient.
    boundary = {key: value.detach() for key, value in split.stage1(x).items()}
    split.stage2(**boundary).backward()
    through_cache = trained.bias.grad.clone()
    trained.zero_grad()
    step(x).backward()
    assert torch.equal(through_cache, trained.bias.grad)


def test_a_detached_snapshot_is_data():
    frozen, trained, x = _parts()
    snapshot = trained.bias.detach().clone()

    def step(x):
        return F.mse_loss(trained(x), frozen(x) * snapshot)

    split = split_and_verify(step, (x,), path="trace")
    assert [key for key in split.boundary if key.startswith("mul")]


def test_a_tensor_that_trains_apart_from_the_model_is_refused():
    frozen, trained, x = _parts()
    scale = torch.ones(4, requires_grad=True)  # optimised by the script, not a parameter

    def step(x):
        return F.mse_loss(trained(x), frozen(x) * scale)

    with pytest.raises(graphsplit.TraceError) as refusal:
        graphsplit.split(step, (x,), path="trace")
    message = str(refusal.value)
    assert "a tensor made outside it that requires grad (shape (4,))" in message
    assert HELD_GRAD_FIX.words in message
    assert line_of(step, "frozen(x) * scale") in message
    assert graphsplit.split(step, (x,)).path == "calls"  # path="auto" falls back
