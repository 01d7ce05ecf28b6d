"""``int()`` of a traced size stays traced (graphsplit/planning/tracing/int_calls.py): a step
whose Python turns a size into an int gets one plan for every size, exact; a size Python reads
(``range``), a function that names ``int`` other than to call it, and a site whose traced int a
library cannot take (json.dumps) or reads as a number (a dict key) keep the guard and a plan
per size, as before."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphsplit
from graphsplit.planning.tracing.int_calls import (
    INT_SITES,
    STAND_IN_NAME,
    _rebound_code,
    traced_int,
)
from tests.signatures.test_boundary_checks import _batch  # pixels (2, 3, 8, w), target (2, 8, w)


def unpack(h: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """diffusers' ``FluxPipeline._unpack_latents`` in small: ``int()`` of sizes, then a view."""
    height = 2 * (int(height) // 2)
    width = 2 * (int(width) // 2)
    return h.reshape(h.shape[0], h.shape[1], height, width)


class Unpacking(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels)
        noisy = latents + 0.1 * torch.randn_like(latents)
        tokens = noisy.flatten(2).transpose(1, 2)
        out = self.head(tokens).transpose(1, 2)
        out = unpack(out, latents.shape[2], latents.shape[3])
        return F.mse_loss(out.mean(1), target)


def rows_in_turn(h: torch.Tensor, count: int) -> torch.Tensor:
    """A Python loop over ``int()`` of a size: ``range`` reads the number, so it is guarded."""
    return torch.stack([h[:, :, i] for i in range(int(count))], 2)


class RowLoop(Unpacking):
    def forward(self, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels)
        out = self.head(latents.transpose(1, 3)).transpose(1, 3)
        out = rows_in_turn(out, latents.shape[2])
        return F.mse_loss(out.mean(1), target)


def checked_size(size: int) -> int:
    """Names ``int`` other than to call it: not rebound, so ``int()`` here is guarded."""
    if not isinstance(size, int):
        raise TypeError(size)
    return int(size)


class Checked(Unpacking):
    def forward(self, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels)
        out = self.head(latents.transpose(1, 3)).transpose(1, 3)
        out = out.reshape(out.shape[0], out.shape[1], -1, checked_size(latents.shape[3]))
        return F.mse_loss(out.mean(1), target)


SCALES = {8: 1.0, 12: 2.0, 16: 3.0}


def scale_of(width: int) -> float:
    """A table keyed by ``int()`` of a size: the traced int hashes as its number, guarded
    (int_calls._reads_its_number), and the lookup's ``==`` is guarded too: a plan per width."""
    return SCALES[int(width)]


class Keyed(Unpacking):
    def forward(self, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels)
        out = self.head(latents.transpose(1, 3)).transpose(1, 3) * scale_of(latents.shape[3])
        return F.mse_loss(out.mean(1), target)


def trains_exactly(model: torch.nn.Module, split: graphsplit.Split, batch: dict) -> bool:
    """Whether stage 2 on stage 1's output gives the eager step's loss and head gradient, bit
    for bit (the same seed before each run)."""
    results = []
    for run in (lambda: split.stage2(**split.stage1(**batch)), lambda: model(**batch)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = run()
        loss.backward()
        results.append((loss.detach(), model.head.weight.grad.clone()))
    (loss, grad), (eager_loss, eager_grad) = results
    return bool(torch.equal(loss, eager_loss) and torch.equal(grad, eager_grad))


def _assert_trains_exactly(model: torch.nn.Module, split: graphsplit.Split, batch: dict) -> None:
    assert trains_exactly(model, split, batch)


def test_int_of_a_size_keeps_one_plan_for_every_width_and_trains_exactly():
    torch.manual_seed(0)
    model = Unpacking()
    split = graphsplit.split(model, kwargs=_batch(8, 0))
    assert split.plans[0].signature.as_dict() == {}
    assert "graphsplit_runtime_check_size" not in split.stage2.code + split.stage1.code
    for seed, width in enumerate((12, 8, 20), start=1):
        _assert_trains_exactly(model, split, _batch(width, seed))
    assert len(split.plans) == 1
    # The function runs its own code again, the stand-in left in its module for stragglers.
    assert (
        unpack.__code__.co_names.count("int") == 1 and STAND_IN_NAME not in unpack.__code__.co_names
    )
    assert unpack.__globals__[STAND_IN_NAME] is traced_int


def test_a_size_python_reads_stays_guarded_and_gets_a_plan_per_size():
    torch.manual_seed(0)
    model = RowLoop()
    split = graphsplit.split(model, kwargs=_batch(8, 0))
    assert list(split.plans[0].signature.as_dict().values()) == [8]
    _assert_trains_exactly(model, split, _batch(8, 1))
    tall = _batch(8, 2)
    tall["pixels"] = torch.randn(2, 3, 12, 8)
    tall["target"] = torch.randn(2, 12, 8)
    _assert_trains_exactly(model, split, tall)
    assert [list(plan.signature.as_dict().values()) for plan in split.plans] == [[8], [12]]


def test_a_function_naming_int_otherwise_is_not_rebound():
    torch.manual_seed(0)
    model = Checked()
    split = graphsplit.split(model, kwargs=_batch(8, 0))
    assert list(split.plans[0].signature.as_dict().values()) == [8]
    _assert_trains_exactly(model, split, _batch(12, 1))
    assert len(split.plans) == 2


def test_a_site_whose_traced_int_is_a_dict_key_reads_its_number_guarded():
    torch.manual_seed(0)
    model = Keyed()
    split = graphsplit.split(model, kwargs=_batch(8, 0))  # accepted, as before int_calls
    assert list(split.plans[0].signature.as_dict().values()) == [8, True]  # the number, == 8
    _assert_trains_exactly(model, split, _batch(12, 1))
    assert len(split.plans) == 2
    # Every split of the step is made the same way, in this
    # process or a fresh one (a cache's code fingerprint must match across processes).
    assert scale_of in INT_SITES._rebound
    again = graphsplit.split(Keyed(), kwargs=_batch(8, 0))
    assert (again.stage1.code, again.stage2.code) == (split.stage1.code, split.stage2.code)


def _source(text: str) -> types.CodeType:
    namespace: dict = {}
    exec(compile(text, "<int_calls test>", "exec"), namespace)
    return namespace["f"].__code__


@pytest.mark.parametrize(
    ("text", "rebound"),
    [
        ("def f(h):\n    return int(h) // 2\n", True),
        ("def f(h, s):\n    return int(h) + int(s, 16)\n", True),
        ("def f(h):\n    return isinstance(h, int) and int(h)\n", False),
        ("def f(h):\n    return type(h) is int\n", False),
        ("def f(t):\n    return t.int()\n", False),
        ("def f(t, h):\n    return t.int() + int(h)\n", False),
        ("def f(h):\n    return h\n", False),
    ],
)
def test_only_code_that_names_int_to_call_it_is_rebound(text, rebound):
    code = _source(text)
    new = _rebound_code(code)
    assert (new is not None) is rebound
    if new is not None:
        assert "int" not in new.co_names and STAND_IN_NAME in new.co_names
        assert new.co_code == code.co_code  # only the name changes


def test_the_stand_in_is_pythons_int_for_everything_but_a_traced_int():
    assert traced_int() == 0
    assert traced_int("ff", 16) == 255 and traced_int("101", base=2) == 5
    assert traced_int(3.7) == 3 and traced_int(-3.7) == -3
    assert traced_int(True) == 1 and type(traced_int(True)) is int
    assert traced_int(torch.tensor(5)) == 5
    with pytest.raises(ValueError, match="invalid literal"):
        traced_int("x")


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(widths=st.lists(st.sampled_from([4, 6, 8, 10, 14]), min_size=2, max_size=3))
def test_one_plan_trains_any_sequence_of_widths_exactly(widths):
    torch.manual_seed(0)
    model = Unpacking()
    split = graphsplit.split(model, kwargs=_batch(widths[0], 0))
    for seed, width in enumerate(widths[1:], start=1):
        _assert_trains_exactly(model, split, _batch(width, seed))
    assert len(split.plans) == 1
