"""The one patcher: every change a trace makes to the process is undone, however it ends.

Unit tests of :class:`~graphsplit.planning.patching.patcher.Patcher` first (exact undo of an
own, inherited or missing attribute; revert / reapply; meta-reverted patches; per-thread
state), then whole splits that end normally, with a ``TraceError``, a ``SplitError``, an
exception or a ``KeyboardInterrupt`` raised in the user's step, each checked against a
snapshot of everything the trace touches taken before.
"""

from __future__ import annotations

import builtins
import gc
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import einops
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import graphsplit
from graphsplit.planning.patching.originals import (
    python_callable,
    python_isinstance,
    python_len,
    python_list,
    python_range,
)
from graphsplit.planning.patching.patcher import (
    PLANNING_LOCK,
    Patcher,
    active_patcher,
    patches_reverted,
)
from graphsplit.planning.patching.traced_builtins import replace_python_builtins
from tests.helpers import batch, frozen
from tests.test_errors import LatentsEncoder, LatentsHead

_BUILTINS = ("isinstance", "len", "list", "callable", "range")
_PYTHON = (python_isinstance, python_len, python_list, python_callable, python_range)


# -- the patcher ----------------------------------------------------------------------------------
class _Base:
    inherited = "base"


class _Owner(_Base):
    own = "own"


def test_patches_are_undone_exactly_own_inherited_and_missing_attributes():
    instance = _Owner()
    instance.mine = 1
    with Patcher() as patcher:
        assert patcher.patch(instance, "mine", 2) == 1
        assert patcher.patch(instance, "own", "patched own") == "own"  # from the class
        assert patcher.patch_method(_Owner, "own", "class own") == "own"
        assert patcher.patch_method(_Owner, "inherited", "class inherited") == "base"
        assert (instance.mine, vars(instance)["own"]) == (2, "patched own")
        assert (_Owner.own, _Owner.inherited) == ("class own", "class inherited")
    assert vars(instance) == {"mine": 1}  # the instance attribute it lacked is gone again
    assert vars(_Owner)["own"] == "own" and "inherited" not in vars(_Owner)
    assert _Owner.inherited == "base"


def test_a_slot_of_a_class_follows_its_patch_and_its_undo():
    def new(cls, *args, **kwargs):
        return "made"

    before = vars(torch.Tensor).get("__new__", None)
    with Patcher() as patcher:
        patcher.patch_method(torch.Tensor, "__new__", staticmethod(new))
        assert torch.Tensor([1.0]) == "made"
    assert vars(torch.Tensor).get("__new__", None) is before
    assert torch.equal(torch.Tensor([1.0]), torch.ones(1))


def test_the_same_attribute_patched_twice_comes_back_to_the_original():
    with Patcher() as outer:
        outer.patch(_Owner, "own", "outer")
        with Patcher() as inner:
            inner.patch(_Owner, "own", "inner")
            outer.patch(_Owner, "inherited", "late")
            assert (_Owner.own, _Owner.inherited) == ("inner", "late")
        assert _Owner.own == "outer"
    assert _Owner.own == "own" and "inherited" not in vars(_Owner)


def test_revert_all_reapply_all_and_reverted():
    with Patcher() as patcher:
        patcher.patch(_Owner, "own", "patched")
        patcher.revert_all()
        assert _Owner.own == "own" and not patcher.traces_here()
        patcher.reapply_all()
        assert _Owner.own == "patched" and patcher.traces_here()
        with patcher.reverted():
            assert _Owner.own == "own"
        assert _Owner.own == "patched"
    assert _Owner.own == "own"


def test_a_patcher_is_used_only_inside_its_block():
    patcher = Patcher()
    with pytest.raises(RuntimeError, match="inside its own with block"):
        patcher.patch(_Owner, "own", "patched")
    with pytest.raises(TypeError, match="patches a class"), Patcher() as inside:
        inside.patch_method(_Owner(), "own", "patched")
    assert _Owner.own == "own"


@pytest.mark.parametrize("raised", [ValueError("boom"), KeyboardInterrupt()])
def test_patches_are_undone_when_the_block_raises(raised):
    with pytest.raises(type(raised)), Patcher() as patcher:
        patcher.patch(_Owner, "own", "patched")
        patcher.patch(builtins, "len", _same_len, reverted_for_meta=True)
        raise raised
    assert _Owner.own == "own" and builtins.len is python_len and active_patcher() is None


def test_patches_are_undone_when_a_generator_holding_them_is_closed():
    def patched_steps() -> Iterator[int]:
        with Patcher() as patcher:
            patcher.patch(_Owner, "own", "patched")
            yield 1
            yield 2

    steps = patched_steps()
    assert next(steps) == 1 and _Owner.own == "patched"
    steps.close()
    assert _Owner.own == "own" and active_patcher() is None


def test_an_entered_context_exits_with_the_patches():
    exited = []

    class Context:
        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            exited.append(_Owner.own)  # the patches are undone first

    with Patcher() as patcher:
        patcher.patch(_Owner, "own", "patched")
        patcher.enter_context(Context())
    assert exited == ["own"]


def _same_len(obj: Any) -> int:
    """A stand-in for ``len``, told apart by identity only: threads and pytest call ``len``."""
    return python_len(obj)


def _same_callable(obj: Any) -> bool:
    return python_callable(obj)


def test_patches_reverted_lifts_the_meta_reverted_patches_once_however_nested():
    with Patcher() as patcher:
        patcher.patch(builtins, "len", _same_len, reverted_for_meta=True)
        patcher.patch(_Owner, "own", "patched")  # the replacement checks the trace's state
        assert builtins.len is _same_len
        with patches_reverted():
            assert builtins.len is python_len and _Owner.own == "patched"
            with patches_reverted():
                assert builtins.len is python_len
            assert builtins.len is python_len  # still lifted: the outer block has not ended
            patcher.patch(builtins, "callable", _same_callable, reverted_for_meta=True)
            assert builtins.callable is python_callable
        assert builtins.len is _same_len and builtins.callable is _same_callable
    assert builtins.len is python_len and builtins.callable is python_callable
    with patches_reverted():  # outside a trace: nothing to lift
        assert builtins.len is python_len


def test_a_builtin_patched_twice_is_lifted_to_pythons_and_put_back_to_the_last():
    def other_len(obj: Any) -> int:
        return python_len(obj)

    with Patcher() as patcher:
        patcher.patch(builtins, "len", _same_len, reverted_for_meta=True)
        patcher.patch(builtins, "len", other_len, reverted_for_meta=True)
        with patches_reverted():
            assert builtins.len is python_len
        assert builtins.len is other_len
        with pytest.raises(TypeError, match="own attribute"):
            patcher.patch(_Owner, "own", "patched", reverted_for_meta=True)
    assert builtins.len is python_len and _Owner.own == "own"


def test_patches_reverted_in_another_thread_leaves_the_tracing_threads_patches_alone():
    seen = []

    def other_thread():
        with patches_reverted():
            seen.append((active_patcher(), builtins.len is _same_len))

    with Patcher() as patcher:
        patcher.patch(builtins, "len", _same_len, reverted_for_meta=True)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert builtins.len is _same_len and patcher.traces_here()
    assert seen == [(None, True)]


def test_a_second_patcher_in_another_thread_waits_for_the_first():
    order = []

    def other_thread():
        with Patcher():
            order.append("second")

    with Patcher():
        thread = threading.Thread(target=other_thread)
        thread.start()
        # The other thread cannot take the lock while this one holds it; it is released only
        # at the end of this block, after "first" is recorded.
        assert not PLANNING_LOCK.acquire(blocking=False) or _release_and_true()
        order.append("first")
    thread.join()
    assert order == ["first", "second"]


def _release_and_true() -> bool:
    PLANNING_LOCK.release()  # reentrant: this thread holds it already
    return True


def test_a_list_subclass_made_while_patched_is_a_plain_list_subclass():
    with Patcher() as patcher:
        replace_python_builtins(patcher, ())
        assert builtins.list is not python_list

        class Rows(list):
            pass

    assert Rows.__bases__ == (python_list,) and type(Rows) is type
    assert isinstance(Rows([1]), list) and not isinstance([], Rows)


# -- whole splits: the process is as before, however the split ends -----------------------------
_FAKE_TENSOR_LOGGER = logging.getLogger("torch._subclasses.fake_tensor")


def _namespaces() -> dict[str, Any]:
    """Everything a trace patches: the objects themselves, compared by identity."""
    return {
        "builtins": builtins,
        "torch": torch,
        "torch.Tensor": torch.Tensor,
        "torch.nn.functional": F,
        "torch.utils.checkpoint": torch.utils.checkpoint,
        "einops.einops": sys.modules["einops.einops"],
    }


def _snapshot() -> dict[str, Any]:
    state: dict[str, Any] = {
        name: dict(vars(namespace)) for name, namespace in _namespaces().items()
    }
    state["gc enabled"] = gc.isenabled()
    state["fake tensor logger"] = (_FAKE_TENSOR_LOGGER.disabled, _FAKE_TENSOR_LOGGER.level)
    state["active patcher"] = active_patcher()
    state["lock free"] = _lock_is_free()
    return state


def _lock_is_free() -> bool:
    result: list[bool] = []

    def probe():  # another thread: the lock is reentrant for this one
        acquired = PLANNING_LOCK.acquire(blocking=False)
        if acquired:
            PLANNING_LOCK.release()
        result.append(acquired)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result[0]


def _assert_as_before(before: dict[str, Any]) -> None:
    after = _snapshot()
    for name in _namespaces():
        added = sorted(set(after[name]) - set(before[name]))
        removed = sorted(set(before[name]) - set(after[name]))
        rebound = sorted(
            key
            for key in set(before[name]) & set(after[name])
            if after[name][key] is not before[name][key]
        )
        assert (added, removed, rebound) == ([], [], []), name
    for key in ("gc enabled", "fake tensor logger", "active patcher", "lock free"):
        assert after[key] == before[key], key
    assert tuple(getattr(builtins, name) for name in _BUILTINS) == _PYTHON


class Plain(nn.Module):
    """Frozen encoder, trainable head; uses len, list, range, zeros, einops, a check."""

    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.fail = fail

    def forward(self, x):
        features = self.encoder(x)
        if self.fail is not None:
            raise self.fail
        rows = list(features)
        assert isinstance(rows, list) and callable(self.head)
        torch._check(features.shape[0] > 0)
        offset = torch.zeros(len(x), 4) + sum(range(len(rows[0])))
        features = einops.rearrange(features + offset, "b c -> b c")
        return torch.utils.checkpoint.checkpoint(self.head, features, use_reentrant=False).mean()


class ReadsATensorValue(Plain):
    def forward(self, x):
        features = self.encoder(x)
        if features.sum() > 0:  # control flow on a value: a TraceError
            return self.head(features).mean()
        return self.head(-features).mean()


class CrossesWithoutCodec(nn.Module):
    """A non-tensor value must cross the boundary: a SplitError, after the trace."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = LatentsEncoder().requires_grad_(False)
        self.head = LatentsHead()

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """One split first: torch's lazy imports fill its namespace once, not during a test."""
    graphsplit.split(Plain(), (batch(3, 4),))


def test_after_a_split_that_succeeds_the_process_is_as_before():
    before = _snapshot()
    model = Plain()
    methods = {id(module): dict(vars(module)) for module in model.modules()}
    split = graphsplit.split(model, (batch(3, 4),))
    assert all(c.ok for c in graphsplit.verify(model, split, (batch(3, 4),)))
    _assert_as_before(before)
    for module in model.modules():  # no leaf keeps a recording wrapper
        assert set(vars(module)) == set(methods[id(module)])


@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        (ReadsATensorValue(), graphsplit.TraceError, "depends on the value of a tensor"),
        (CrossesWithoutCodec(), graphsplit.SplitError, "Latents"),
        (Plain(fail=ValueError("the step's own bug")), ValueError, "the step's own bug"),
        (Plain(fail=KeyboardInterrupt()), KeyboardInterrupt, None),
    ],
    ids=["TraceError", "SplitError", "step raises", "KeyboardInterrupt"],
)
def test_after_a_split_that_fails_the_process_is_as_before(model, error, match):
    before = _snapshot()
    with pytest.raises(error, match=match):
        graphsplit.split(model, (batch(3, 4),), path="trace")
    _assert_as_before(before)
