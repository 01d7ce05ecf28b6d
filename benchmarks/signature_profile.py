"""Where a new shape signature's plan spends its time, and how much of it the first plan met.

Glossary:
    node run: one node's meta run (:meth:`MetaInterpreter.run_on_meta`), in the trace (the
        node's value) or in the probe at the second batch size: a whole leaf call (a VAE's
        ``encode``, a text encoder, the DiT), a torch function, a tensor method.
    met by the first plan: the node run's key (what it runs, whether its ops are recorded,
        which arguments are one object, the arguments' metadata and values: the call memo's
        ``_node_signature`` before the module's state) was met while the first plan was made,
        i.e. the first plan ran the same function on arguments of the same metadata. Such a
        run is the most any reuse of the first plan's work could answer: every other node run
        sees a shape (or value) the first plan never saw.
    outside node runs: the rest of the plan: the step's own Python under the tracer, the
        probes' bookkeeping, the cut, codegen, the signature.

The reuse ceiling is ``(met by the first plan) / (the whole plan)``: a plan made by reusing
the first plan's work where its inputs are the same costs at least ``1 - ceiling`` of itself.

In and out::

    new_plan_profile(split, args, kwargs) -> dict   seconds per part, node runs per part
"""

from __future__ import annotations

import time
from typing import Any

import torch

from graphsplit.planning.meta import meta_interpreter
from graphsplit.planning.meta.call_signature import DEPTH, sameness, value_key


def _described(interpreter: Any, node: Any, record: bool) -> Any:
    """The key ``call_memo._node_signature`` checks against the memo's ``seen`` set, or None."""
    head, module = interpreter._memo_head(node)
    if head is None:
        return None
    arguments = interpreter.fetch_args_kwargs_from_env(node)
    with torch._C.DisableTorchFunction():
        try:
            return (head, record, sameness(arguments, module), value_key(arguments, DEPTH))
        except TypeError:
            return None


def new_plan_profile(split: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Make the plan for ``(args, kwargs)`` on ``split`` (whose planner made the first plan
    only) as the dispatcher makes it, timing each node run and whether the first plan met it."""
    planner = split.plan_set._make_plan.__self__
    met_before = set(planner.memos.seen)
    seconds = {"met by the first plan": 0.0, "new to this plan": 0.0, "no key": 0.0}
    counts = dict.fromkeys(seconds, 0)
    original = meta_interpreter.MetaInterpreter.run_on_meta
    depth = [0]
    seconds_keying = [0.0]  # the profile's own keys: taken off the plan's time

    def timed(self: Any, node: Any, *, record: bool) -> Any:
        if depth[0]:  # a node run inside another's (not expected): counted in the outer one
            return original(self, node, record=record)
        keyed = time.perf_counter()
        described = _described(self, node, record)
        seconds_keying[0] += time.perf_counter() - keyed
        part = (
            "no key"
            if described is None
            else "met by the first plan"
            if described in met_before
            else "new to this plan"
        )
        depth[0] += 1
        started = time.perf_counter()
        try:
            return original(self, node, record=record)
        finally:
            seconds[part] += time.perf_counter() - started
            counts[part] += 1
            depth[0] -= 1

    meta_interpreter.MetaInterpreter.run_on_meta = timed  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        plan = split.plan_set._make_plan(args, kwargs)
        total = time.perf_counter() - started - seconds_keying[0]
    finally:
        meta_interpreter.MetaInterpreter.run_on_meta = original  # type: ignore[method-assign]
    outside = total - sum(seconds.values())
    return {
        "plan_s": total,
        "plan_key": plan.key,
        "seconds": {**seconds, "outside node runs": outside},
        "node_runs": counts,
        "reuse_ceiling": seconds["met by the first plan"] / total,
    }
