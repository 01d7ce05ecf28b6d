"""einops calls on traced values, recorded as one node each while a step is traced.

Glossary:
    einops call: ``rearrange`` / ``repeat`` on traced values, one node each, as written
        (:func:`record_einops_calls`).

In: the trace's patcher and the tracer. Out: nothing; the replacement of ``einops.einops.reduce``
is registered with the patcher (when einops is loaded):

    record_einops_calls(patcher, tracer) -> None
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from graphsplit.planning.patching.originals import python_callable, python_isinstance
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_values import contains_proxy

__all__ = ["record_einops_calls"]


def record_einops_calls(patcher: Patcher, tracer: Any) -> None:
    """``rearrange(x, pattern, f=f)`` / ``repeat(...)`` on traced values: one node each.

    Traced values pass einops' ``isinstance`` check, so einops would run on them op by op
    (a dozen ``reshape`` / ``permute`` / size-arithmetic nodes per call, correct but hard to
    read). Both functions call ``einops.einops.reduce`` by its global name, which is replaced
    here, so the call is recorded as written: ``einops.rearrange(x, 'b c f h w -> b (f h w)
    c')``, its axis lengths traced. einops is not imported here: only a step that uses it
    has it loaded.
    """
    module = sys.modules.get("einops.einops")
    if module is None or not python_callable(getattr(module, "reduce", None)):
        return
    original = module.reduce
    as_written = {"rearrange": module.rearrange, "repeat": module.repeat}

    @functools.wraps(original)
    def reduce(tensor: Any, pattern: str, reduction: Any, **axes_lengths: Any) -> Any:
        traced = contains_proxy((tensor, axes_lengths))
        if tracer.computing_meta or not traced or not python_isinstance(reduction, str):
            return original(tensor, pattern, reduction, **axes_lengths)
        if reduction in as_written:
            return tracer.create_proxy(
                "call_function", as_written[reduction], (tensor, pattern), axes_lengths
            )
        return tracer.create_proxy(
            "call_function", original, (tensor, pattern, reduction), axes_lengths
        )

    patcher.patch(module, "reduce", reduce)
