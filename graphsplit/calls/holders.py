"""Stand-in forwards that answer cached calls from the cache, in the step's call order.

Stage 2 routes the frozen modules' calls through :class:`StageRoutes` (made once, installed
around each step, as :class:`~graphsplit.calls.module_calls.CallRouter` routes the probes'
and stage 1's): a cached call returns its output rebuilt from the batch's cached tensors
(a transformers ``ModelOutput`` comes back as one, so ``.image_embeds`` / ``[0]`` read as
before) without touching the module's weights, an
:class:`~graphsplit.calls.field_reads.Unstored` stand-in on ``meta`` in each field not stored
(stage 2 never computes with it); a cached call only cached calls read comes back as such
stand-ins only; any other call runs the module's forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from graphsplit.calls.call_plan import CachedCall, CallPlan
from graphsplit.calls.field_reads import unstored
from graphsplit.calls.module_calls import CallId
from graphsplit.calls.outputs import Answer, answerer
from graphsplit.errors import Fix, SplitError, user_error


def answers(plan: CallPlan) -> dict[CallId, Answer]:
    """Per cached call of ``plan``, the function that rebuilds its output (made once a stage)."""
    table = {}
    for call, planned in plan.cached.items():
        label = f"{call[0]} call {call[1]}"
        keys = {**planned.keys, **{field: _slot(field) for field in planned.unread}}
        answer = answerer(planned.structure, keys, label)
        if planned.copied:
            answer = _copying(answer, [planned.keys[field] for field in planned.copied])
        if planned.unread:
            answer = _filling(answer, planned, label)
        if planned.fold is not None:
            answer = _unfolding(answer, planned)
        table[call] = answer
    for call, held in plan.placeholders.items():
        label = f"{call[0]} call {call[1]}"
        keys = {name: name for name in held.fields}
        meta = {
            name: unstored(shape, dtype, f"{label}'s {name}", shaped=False)
            for name, (shape, dtype) in held.fields.items()
        }
        answer = answerer(held.structure, keys, label)
        table[call] = lambda _cached, answer=answer, meta=meta: answer(meta)
    return table


def _slot(field: str) -> str:
    """The key an unread field's stand-in takes beside the batch's (never a boundary key)."""
    return f"\0unread {field}"


def _filling(answer: Answer, planned: CachedCall, label: str) -> Answer:
    """``answer`` with the unread fields' stand-ins beside the batch's cached tensors: made
    once where the shape is the probe's, each step where the batch's shape is stored."""
    fixed, shaped = {}, []
    for field, unread in planned.unread.items():
        where = f"{label}'s {field}"
        # Without a stored shape: an unbatched field's shape is the probe's; a batched one's
        # may not be, and reading it raises (no probe read it).
        if unread.shape_key is None:
            made = unstored(unread.shape, unread.dtype, where, shaped=not unread.batched)
            fixed[_slot(field)] = made
        else:
            shaped.append((_slot(field), unread.shape_key, unread.dtype, where))

    def filled(cached: Mapping[str, torch.Tensor]) -> Any:
        stand_ins = dict(fixed)
        for slot, key, dtype, where in shaped:
            stand_ins[slot] = unstored(_batch_shape(cached[key], where), dtype, where, shaped=True)
        return answer({**cached, **stand_ins})

    return filled


def _batch_shape(rows: torch.Tensor, where: str) -> tuple[int, ...]:
    """The shape of a batch's field from its per-sample rows ``[1, *shape[1:]]``."""
    if not bool((rows == rows[:1]).all()):
        raise user_error(
            SplitError,
            f"the samples of this batch had {where} of different shapes "
            f"({sorted({tuple(row) for row in rows.tolist()})}); the step reads its shape, "
            "and one batch's field has one shape.",
            fix=Fix("batch samples whose frozen calls return outputs of the same shape"),
        )
    return (int(rows.shape[0]), *(int(size) for size in rows[0, 1:].tolist()))


def _unfolding(answer: Answer, planned: CachedCall) -> Answer:
    """``answer`` given the call's own ``[k * B, ...]`` rows of each stored ``[B, k, ...]``
    field (:mod:`.row_folds`)."""
    fold = planned.fold
    keys = [key for field, key in planned.keys.items() if field not in planned.echoed]

    def unfolded(cached: Mapping[str, torch.Tensor]) -> Any:
        return answer({**cached, **{key: fold.unfold(cached[key]) for key in keys}})  # type: ignore[union-attr]

    return unfolded


def _copying(answer: Answer, keys: list[str]) -> Answer:
    """``answer`` handing out copies of ``keys``: the step writes them in place, and the batch's
    cached tensors (read again next epoch, or by ``verify``) must stay as stage 1 wrote them."""

    def copied(cached: Mapping[str, torch.Tensor]) -> Any:
        return answer({**cached, **{key: cached[key].clone() for key in keys}})

    return copied


def _not_held(call: CallId) -> SplitError:
    return user_error(
        SplitError,
        f"this batch makes call {call[1]} of {call[0]}, which the module-level plan "
        "did not see; stage 2 does not hold that module.",
        fix=Fix("split with an example batch that makes the same frozen calls"),
    )


_ABSENT = object()
"""An instance dict without its own ``forward`` (the class's is called)."""


def _give_back(instance: dict[str, Any], name: str, own: Any) -> None:
    """Put the instance's own ``name`` back (none, when it had none: the class's is looked up)."""
    if own is _ABSENT:
        instance.pop(name, None)
    else:
        instance[name] = own


def _skipped_on_meta(module: nn.Module) -> Any:
    """``module._apply`` (what ``.to()``, ``.cuda()``, ``.half()`` and a parent's move run),
    skipped while the module holds a tensor on ``meta``: stage 2 never computes with a module
    it does not hold, and moving its meta weights would raise ("Cannot copy out of meta
    tensor")."""

    def _apply(*args: Any, **kwargs: Any) -> nn.Module:
        tensors = (*module.parameters(), *module.buffers())
        if any(tensor.is_meta for tensor in tensors):
            return module
        return type(module)._apply(module, *args, **kwargs)

    return _apply


class StageRoutes:
    """Stage 2's routes, made once and installed around every step.

    What :class:`~graphsplit.calls.module_calls.CallRouter` with an answering handler does, with
    the per-step objects gone: the routed forwards, the answers by module and call index and
    the list of instance dicts to write are made here once; a step only resets the call
    counts, writes each routed module's ``forward`` and takes it back (``bench_calls_overhead
    --steps 20``, tiny KD: "calls stage 2 / free call" 1.016–1.017 before, 1.008–1.012 after;
    docs/benchmarks.md). A step does not record the call order or the nesting: stage 2 only
    answers.

    Each step first checks that every routed module's own ``forward`` (its instance-dict
    entry, or none) is the one these routes were made over; a library that wrapped it since
    (accelerate's hooks) makes the stage build its routes again. The calls that are not
    answered (a frozen module routed because a cached call runs inside it) look the class's
    ``forward`` up when they run, so a patched class is honoured too.
    """

    __slots__ = ("active", "applies", "cached", "counts", "depth", "installs")

    def __init__(self, plan: CallPlan, modules: dict[str, nn.Module], table: dict) -> None:
        by_path: dict[str, dict[int, Answer]] = {}
        for (path, index), answer in table.items():
            by_path.setdefault(path, {})[index] = answer
        not_held = plan.not_held
        self.installs = [
            (module.__dict__, self._route(path, module, by_path.get(path, {}), not_held, own), own)
            for path, module in modules.items()
            for own in [module.__dict__.get("forward", _ABSENT)]
        ]
        # A module stage 2 does not hold may be on meta in a stage-2 process; the step's own
        # moves of it (vae.to(device) every step, as --offload scripts do) then skip it.
        self.applies = [
            (module.__dict__, _skipped_on_meta(module), module.__dict__.get("_apply", _ABSENT))
            for path, module in modules.items()
            if path in not_held
        ]
        self.counts: dict[str, int] = {}
        self.depth = 0
        self.cached: Mapping[str, torch.Tensor] = {}
        self.active = False

    def current(self) -> bool:
        """Whether every routed module still has the ``forward`` these routes were made over."""
        return all(instance.get("forward", _ABSENT) is own for instance, _, own in self.installs)

    def install(self, cached: Mapping[str, torch.Tensor]) -> None:
        """Answer from ``cached`` until :meth:`remove` (the caller checked :meth:`current`)."""
        self.counts = {}
        self.depth = 0
        self.cached = cached
        self.active = True
        for instance, routed, _ in self.installs:
            instance["forward"] = routed
        for instance, skipped, _ in self.applies:
            instance["_apply"] = skipped

    def remove(self) -> None:
        """Give every routed module its own ``forward`` back."""
        for instance, _, own in self.installs:
            _give_back(instance, "forward", own)
        for instance, _, own in self.applies:
            _give_back(instance, "_apply", own)
        self.cached = {}
        self.active = False

    def _route(
        self,
        path: str,
        module: nn.Module,
        mine: dict[int, Answer],
        not_held: frozenset[str],
        own: Any,
    ) -> Any:

        def forward() -> Any:
            return own if own is not _ABSENT else type(module).forward.__get__(module)

        def routed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # inside another routed call: that call's own business
                return forward()(*args, **kwargs)
            index = self.counts.get(path, 0)
            self.counts[path] = index + 1
            answer = mine.get(index)
            if answer is not None:
                return answer(self.cached)
            if path in not_held:
                raise _not_held((path, index))
            self.depth += 1
            try:
                return forward()(*args, **kwargs)
            finally:
                self.depth -= 1

        return routed
