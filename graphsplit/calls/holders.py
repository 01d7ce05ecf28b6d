"""Stand-in forwards that answer cached calls from the cache, in the step's call order.

Stage 2 routes the frozen modules' calls (:class:`~graphsplit.calls.module_calls.CallRouter`)
to :func:`answering`: a cached call returns its output rebuilt from the batch's cached tensors
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

from graphsplit.calls.call_plan import CachedCall, CallPlan
from graphsplit.calls.field_reads import unstored
from graphsplit.calls.module_calls import CallId, Handler
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


def _copying(answer: Answer, keys: list[str]) -> Answer:
    """``answer`` handing out copies of ``keys``: the step writes them in place, and the batch's
    cached tensors (read again next epoch, or by ``verify``) must stay as stage 1 wrote them."""

    def copied(cached: Mapping[str, torch.Tensor]) -> Any:
        return answer({**cached, **{key: cached[key].clone() for key in keys}})

    return copied


def answering(
    plan: CallPlan, cached: Mapping[str, torch.Tensor], made: dict[CallId, Answer] | None = None
) -> Handler:
    """The handler that answers ``plan``'s cached calls from ``cached`` (boundary key -> tensor),
    with ``made`` (:func:`answers` of the same plan) when the caller keeps them."""
    table = answers(plan) if made is None else made

    def handle(call: Any, module: Any, forward: Any, args: tuple, kwargs: dict) -> Any:
        answer = table.get(call)
        if answer is not None:
            return answer(cached)
        if call[0] in plan.not_held:
            raise user_error(
                SplitError,
                f"this batch makes call {call[1]} of {call[0]}, which the module-level plan "
                "did not see; stage 2 does not hold that module.",
                fix=Fix("split with an example batch that makes the same frozen calls"),
            )
        return forward(*args, **kwargs)

    return handle
