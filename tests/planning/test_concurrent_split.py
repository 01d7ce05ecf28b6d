"""``graphsplit.split`` from several threads at once, and other threads while one traces.

Concurrent splits wait for each other (the trace patches the process; the patcher and
``split`` hold one process-wide lock), so each makes the plan it makes alone. A thread that
is not tracing keeps Python's and torch's answers while a trace runs in another: the test
pauses a trace inside the step's ``forward`` (events, no sleeps) and asks from outside.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

import graphsplit
from graphsplit.planning.patching.originals import (
    python_callable,
    python_isinstance,
    python_len,
    python_list,
    python_range,
)
from graphsplit.planning.patching.patcher import active_patcher
from tests.helpers import batch, frozen

_TIMEOUT = 600  # seconds: a bound on a hang, never a synchronisation


# -- small steps: a frozen encoder and a trainable head ----------------------------------------
class LinearHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 4)))
        self.head = nn.Linear(4, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(self.encoder(x)), y)


class ConvHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Conv2d(3, 4, 3, padding=1))
        self.head = nn.Conv2d(4, 1, 1)

    def forward(self, pixels):
        features = self.encoder(pixels)
        noise = torch.randn_like(features)  # a random draw: replayed in stage 2
        return self.head(features + 0.1 * noise).square().mean()


class PythonBuiltins(nn.Module):
    """``len``, ``list``, ``range``, ``isinstance`` and ``torch.zeros`` on traced values."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        features = self.encoder(x)
        rows = list(features)
        assert isinstance(rows, list) and isinstance(features, torch.Tensor)
        offset = torch.zeros(len(x), 4) + sum(range(len(rows[0])))
        return self.head(torch.stack(rows) + offset).mean()


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = frozen(nn.Embedding(10, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, ids, labels):
        logits = self.head(self.table(ids).mean(dim=1))
        return nn.functional.cross_entropy(logits, labels)


def _linear_head() -> tuple[nn.Module, tuple[Any, ...]]:
    return LinearHead(), (batch(3, 6), batch(3, 1, seed=1))


def _conv_head() -> tuple[nn.Module, tuple[Any, ...]]:
    return ConvHead(), (batch(2, 3, 5, 5),)


def _python_builtins() -> tuple[nn.Module, tuple[Any, ...]]:
    return PythonBuiltins(), (batch(3, 4),)


def _embedding() -> tuple[nn.Module, tuple[Any, ...]]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 10, (4, 5), generator=generator)
    return Embedding(), (ids, torch.randint(0, 2, (4,), generator=generator))


def _sd_lora() -> tuple[nn.Module, tuple[Any, ...]]:
    from tests.test_api_real_models import _batch
    from tests.zoo import build_sd_lora_step

    return build_sd_lora_step(seed=0), _batch()


Builder = Callable[[], tuple[nn.Module, tuple[Any, ...]]]


def _built(builder: Builder) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)  # the same weights each time it is built
    return builder()


def _plan(split: graphsplit.Split) -> tuple[Any, ...]:
    return split.to_json(), split.stage1.code, split.stage2.code


def _split_at_once(work: list[tuple[nn.Module, tuple[Any, ...]]]) -> list[graphsplit.Split]:
    """``graphsplit.split`` of every step, each in its own thread, all released together."""
    start = threading.Barrier(len(work))
    results: list[Any] = [None] * len(work)

    def run(index: int) -> None:
        model, args = work[index]
        try:
            start.wait(timeout=_TIMEOUT)
            results[index] = graphsplit.split(model, args)
        except BaseException as error:  # reported below, in the test's thread
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a split never ended"
    errors = [result for result in results if isinstance(result, BaseException)]
    assert not errors, errors
    return results


def _assert_builtins_are_pythons() -> None:
    assert (
        builtins.isinstance,
        builtins.len,
        builtins.list,
        builtins.callable,
        builtins.range,
    ) == (python_isinstance, python_len, python_list, python_callable, python_range)


@pytest.mark.parametrize(
    "builders",
    [
        [_linear_head, _python_builtins],
        [_linear_head, _conv_head, _python_builtins, _embedding],
        [_sd_lora, _python_builtins],
    ],
    ids=["two small steps", "four small steps", "sd lora and a small step"],
)
def test_concurrent_splits_succeed_verify_and_equal_the_plans_made_one_at_a_time(builders):
    alone = [_plan(graphsplit.split(*_built(builder))) for builder in builders]
    work = [_built(builder) for builder in builders]
    factories = {name: getattr(torch, name) for name in ("zeros", "ones", "empty", "randn")}
    splits = _split_at_once(work)
    _assert_builtins_are_pythons()
    assert {name: getattr(torch, name) for name in factories} == factories
    for (model, args), split, plan in zip(work, splits, alone, strict=True):
        assert _plan(split) == plan
        comparisons = graphsplit.verify(model, split, args, seed=0)
        assert comparisons and all(comparison.ok for comparison in comparisons)


def test_the_same_step_split_by_four_threads_gives_four_equal_plans():
    work = [_built(_python_builtins) for _ in range(4)]
    plans = [_plan(split) for split in _split_at_once(work)]
    assert all(plan == plans[0] for plan in plans)


# -- another thread while one traces -----------------------------------------------------------
class Pause:
    """Where the traced ``forward`` stops, and what it saw there.

    Held outside the module: graphsplit puts back every attribute of the step's modules and
    of the helper objects they hold once the trace ends, events included.
    """

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.resume = threading.Event()
        self.traced_input: Any = None
        self.answers_here: tuple[Any, ...] = ()


_PAUSES: list[Pause] = []


class PausesInsideTheTrace(PythonBuiltins):
    """Stops once inside its traced ``forward`` until the test has asked its questions."""

    def forward(self, x):
        features = self.encoder(x)
        pause = _PAUSES[-1]
        if pause.traced_input is None and python_isinstance(x, torch.fx.Proxy):
            pause.traced_input = x
            pause.answers_here = (isinstance(x, torch.Tensor), callable(x), len(x))
            pause.inside.set()
            assert pause.resume.wait(timeout=_TIMEOUT), "the test never resumed the trace"
        return self.head(features).mean()


def test_a_thread_that_is_not_tracing_gets_pythons_and_torchs_answers_meanwhile():
    model, pause = PausesInsideTheTrace(), Pause()
    _PAUSES.append(pause)
    outcome: list[Any] = []

    def trace() -> None:
        try:
            outcome.append(graphsplit.split(model, (batch(3, 4),)))
        except BaseException as error:
            outcome.append(error)

    tracing = threading.Thread(target=trace)
    tracing.start()
    try:
        assert pause.inside.wait(timeout=_TIMEOUT), "the trace never reached forward"
        # The trace is paused inside forward, its patches in place ...
        assert builtins.isinstance is not python_isinstance
        assert builtins.len is not python_len and torch.zeros.__name__ != "zeros"
        # ... and this thread gets the answers it gets without one.
        assert active_patcher() is None
        assert isinstance([1], list) and isinstance((1,), tuple) and not isinstance(1, str)
        assert isinstance(torch.ones(1), torch.Tensor) and isinstance(True, (int, str))
        assert len([1, 2, 3]) == 3 and len("ab") == 2 and len({"a": 1}) == 1
        assert callable(len) and not callable(3)
        assert list("ab") == ["a", "b"] and type(list("ab")) is python_list
        assert [*range(3)] == [0, 1, 2] and isinstance(range(2), range)
        zeros = torch.zeros(2, 3)
        assert type(zeros) is torch.Tensor and zeros.shape == (2, 3) and not zeros.any()
        assert torch.ones(2).sum().item() == 2.0 and torch.Tensor([1.0, 2.0]).tolist() == [1, 2]
        # A traced value, handed over, gets Python's answers here: no eager answer, no node.
        traced = pause.traced_input
        nodes = len(traced.tracer.graph.nodes)
        assert not isinstance(traced, torch.Tensor) and callable(traced)
        assert len(traced.tracer.graph.nodes) == nodes
    finally:
        pause.resume.set()
        tracing.join(timeout=_TIMEOUT)
    assert not tracing.is_alive()
    (split,) = outcome
    assert isinstance(split, graphsplit.Split), split
    # In the tracing thread a traced tensor is a tensor, not callable, with a traced length.
    is_tensor, is_callable, length = pause.answers_here
    assert is_tensor and not is_callable and python_isinstance(length, torch.fx.Proxy)
    _assert_builtins_are_pythons()
