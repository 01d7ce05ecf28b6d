"""Stand-in forwards that answer cached calls from the cache, in the step's call order.

Stage 2 routes the frozen modules' calls (:class:`~graphsplit.calls.module_calls.CallRouter`)
to :func:`answering`: a cached call returns its output rebuilt from the batch's cached tensors
(a transformers ``ModelOutput`` comes back as one, so ``.image_embeds`` / ``[0]`` read as
before) without touching the module's weights; any other call runs the module's forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphsplit.calls.call_plan import CallPlan
from graphsplit.calls.module_calls import Handler
from graphsplit.calls.outputs import rebuild
from graphsplit.errors import Fix, SplitError, user_error


def answering(plan: CallPlan, cached: Mapping[str, torch.Tensor]) -> Handler:
    """The handler that answers ``plan``'s cached calls from ``cached`` (boundary key -> tensor)."""

    def handle(call: Any, module: Any, forward: Any, args: tuple, kwargs: dict) -> Any:
        planned = plan.cached.get(call)
        if planned is None:
            if call[0] in plan.dropped:
                raise user_error(
                    SplitError,
                    f"this batch makes call {call[1]} of {call[0]}, which the module-level plan "
                    "did not see; stage 2 does not hold that module.",
                    fix=Fix("split with an example batch that makes the same frozen calls"),
                )
            return forward(*args, **kwargs)
        fields = {field: cached[key] for field, key in planned.keys.items()}
        return rebuild(planned.structure, fields, label=f"{call[0]} call {call[1]}")

    return handle
