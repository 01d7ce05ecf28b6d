"""The stages route only the frozen modules their plan needs, and count the same calls.

The probe routes every frozen module and counts only outermost calls. The stages route the
modules of the cached calls and the frozen modules whose calls can hold one of theirs
(``needed_routes``); every other frozen module runs without a route. The steps below call a
cached module from inside another frozen module that does not hold it (or holds it under a
second name): routing the cached module alone would count that inner call as an outermost
one and answer it from the cache.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls import call_split
from graphsplit.calls.module_calls import needed_routes

HIDDEN = 4


class Wrapper(nn.Module):
    """A frozen module that calls ``helper`` (a module it may not hold) on its input."""

    def __init__(self, helper: nn.Module, *, register: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        if register:
            self.helper = helper
        else:
            self._held = [helper]  # a plain list: not a submodule

    def forward(self, x):
        helper = self.helper if hasattr(self, "helper") else self._held[0]
        return self.proj(helper(x))


class SharedInside(nn.Module):
    """``shared`` is cached on the batch (its outermost call 0), called inside ``wrapper``
    first on a trainable input (not a call of its own), and again outermost on one (call 1)."""

    def __init__(self, register: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(HIDDEN, HIDDEN)
        self.wrapper = Wrapper(self.shared, register=register)
        self.norm = nn.LayerNorm(HIDDEN)  # frozen, called on a trainable input: not routed
        self.adapter = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)
        self.shared.requires_grad_(False)
        self.wrapper.requires_grad_(False)
        self.norm.requires_grad_(False)

    def forward(self, x):
        h = self.adapter(x)
        inner = self.wrapper(h)
        cached = self.shared(x)
        again = self.shared(self.norm(h) * 2)
        return self.head(inner + cached + again).sum()


def _step_result(step: nn.Module, run) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for param in step.parameters():
        param.grad = None
    loss = run()
    loss.backward()
    grads = [p.grad.clone() for p in step.parameters() if p.requires_grad]
    return loss.detach(), grads


def _exact(step: nn.Module, split, x: torch.Tensor) -> bool:
    want_loss, want_grads = _step_result(step, lambda: step(x))
    boundary = split.stage1(x)
    got_loss, got_grads = _step_result(step, lambda: split.stage2(**boundary))
    return torch.equal(want_loss, got_loss) and all(
        torch.equal(a, b) for a, b in zip(want_grads, got_grads)
    )


@pytest.mark.parametrize("register", [False, True], ids=["plain-attribute", "second-name"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_cached_module_called_inside_another_frozen_module_is_counted_as_the_probe_did(
    register, size
):
    step = SharedInside(register)
    x = torch.randn(size, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    cached = {call for call, _ in split.plan.cached.items()}
    assert cached == {("shared", 0)}
    assert set(split.stage2._routed) == {"shared", "wrapper"}  # not norm, not wrapper.proj
    assert _exact(step, split, x)


def test_routing_the_cached_module_alone_would_break_the_split(monkeypatch):
    """The test above can fail: with only ``shared`` routed, its call inside ``wrapper``
    is counted as call 0 and answered from the cache, and stage 2's loss changes."""
    monkeypatch.setattr(
        call_split,
        "needed_routes",
        lambda model, frozen, cached, nested: {p: m for p, m in frozen.items() if p in cached},
    )
    step = SharedInside(register=False)
    x = torch.randn(2, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    assert set(split.stage2._routed) == {"shared"}
    assert not _exact(step, split, x)


def test_frozen_ancestors_of_a_cached_module_are_routed_under_every_name():
    outer = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Sequential(nn.Linear(HIDDEN, HIDDEN)))
    model = nn.Module()
    model.inner = outer[1][0]  # registered first: its path is "inner"
    model.outer = outer
    model.other = nn.Linear(HIDDEN, HIDDEN)
    frozen = {path: m for path, m in model.named_modules() if path}
    routes = needed_routes(model, frozen, {"inner"}, set())
    assert set(routes) == {"inner", "outer", "outer.1"}
    nested = {("other", "inner"), ("other", "outer.0")}
    assert set(needed_routes(model, frozen, {"inner"}, nested)) == {
        "inner",
        "outer",
        "outer.1",
        "other",
    }


def _instance_state(step: nn.Module) -> list[tuple[str, bool, object]]:
    return [
        (path, "forward" in module.__dict__, module.__dict__.get("forward"))
        for path, module in step.named_modules()
    ]


def test_stage2_leaves_the_users_modules_as_they_were_after_a_step_and_after_an_error():
    step = SharedInside(register=False)
    own_forward = functools.partial(type(step.shared).forward, step.shared)
    step.shared.forward = own_forward  # a forward the user (or a library) set on the instance
    x = torch.randn(2, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    before = _instance_state(step)
    assert ("shared", True, own_forward) in before
    boundary = split.stage1(x)
    assert _instance_state(step) == before
    split.stage2(**boundary).backward()
    assert _instance_state(step) == before

    def fail(module, args):
        raise RuntimeError("the user's step fails")

    handle = step.head.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="the user's step fails"):
        split.stage2(**boundary)
    handle.remove()
    assert _instance_state(step) == before
    assert step.shared.forward is own_forward


def test_a_forward_wrapped_on_the_instance_between_steps_is_the_one_stage2_runs_and_keeps():
    """Stage 2 makes its routes once; a library that wraps a routed module's ``forward`` on
    the instance after a step (accelerate's hooks do) is honoured: the wrapper runs for the
    call stage 2 does not answer, and stays the module's ``forward`` after the step."""
    step = SharedInside(register=False)
    x = torch.randn(2, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    boundary = split.stage1(x)
    assert _exact(step, split, x)
    first_routes = split.stage2.__dict__["_routes"]

    ran = []

    def wrapping(module: nn.Module) -> None:
        inner = module.forward

        def wrapped(*args, **kwargs):
            ran.append(module)
            return inner(*args, **kwargs)

        module.forward = wrapped

    wrapping(step.wrapper)  # routed, not answered: it runs
    wrapping(step.shared)  # call 0 answered from the cache; inside wrapper and call 1 it runs
    before = _instance_state(step)
    want = step(x).detach()
    boundary = split.stage1(x)
    ran.clear()
    assert torch.equal(split.stage2(**boundary), want)
    assert split.stage2.__dict__["_routes"] is not first_routes  # made again, once
    assert ran == [step.wrapper, step.shared, step.shared]
    assert _instance_state(step) == before
    made = split.stage2.__dict__["_routes"]
    split.stage2(**boundary)
    assert split.stage2.__dict__["_routes"] is made


def test_a_forward_patched_on_the_class_after_a_step_is_the_one_stage2_runs(monkeypatch):
    step = SharedInside(register=False)
    x = torch.randn(2, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    assert _exact(step, split, x)
    ran = []
    original = Wrapper.forward

    def patched(self, x):
        ran.append(self)
        return original(self, x)

    monkeypatch.setattr(Wrapper, "forward", patched)
    want = step(x).detach()
    boundary = split.stage1(x)
    ran.clear()
    assert torch.equal(split.stage2(**boundary), want)
    assert ran == [step.wrapper]


def test_a_deep_copy_of_stage2_after_a_step_routes_its_own_modules():
    step = SharedInside(register=False)
    x = torch.randn(2, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    boundary = split.stage1(x)
    want = split.stage2(**boundary).detach()
    before = _instance_state(step)
    copied = copy.deepcopy(split.stage2)
    assert "_routes" not in copied.__dict__
    assert torch.equal(copied(**boundary), want)
    assert _instance_state(step) == before
    assert copied.__dict__["_routes"] is not split.stage2.__dict__["_routes"]
