"""Stand-in forwards that answer cached calls from the cache, in the step's call order.

Stage 2 routes the frozen modules' calls (:class:`~graphsplit.calls.module_calls.CallRouter`)
to :func:`answering`: a cached call returns its output rebuilt from the batch's cached tensors
(a transformers ``ModelOutput`` comes back as one, so ``.image_embeds`` / ``[0]`` read as
before) without touching the module's weights; a cached call only cached calls read comes back
as tensors on ``meta`` (nothing reads them); any other call runs the module's forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphsplit.calls.call_plan import CallPlan
from graphsplit.calls.module_calls import CallId, Handler
from graphsplit.calls.outputs import Answer, answerer
from graphsplit.errors import Fix, SplitError, user_error


def answers(plan: CallPlan) -> dict[CallId, Answer]:
    """Per cached call of ``plan``, the function that rebuilds its output (made once a stage)."""
    table = {}
    for call, planned in plan.cached.items():
        answer = answerer(planned.structure, planned.keys, f"{call[0]} call {call[1]}")
        if planned.copied:
            answer = _copying(answer, [planned.keys[field] for field in planned.copied])
        table[call] = answer
    for call, held in plan.placeholders.items():
        keys = {name: name for name in held.fields}
        meta = {
            name: torch.empty(shape, dtype=dtype, device="meta")
            for name, (shape, dtype) in held.fields.items()
        }
        answer = answerer(held.structure, keys, f"{call[0]} call {call[1]}")
        table[call] = lambda _cached, answer=answer, meta=meta: answer(meta)
    return table


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
