"""Where a new shape signature's plan spends its time, and how much of it the first plan met.

Glossary:
    node run: one node's meta run (:meth:`MetaInterpreter.run_on_meta`), in the trace (the
        node's value) or in the probe at the second batch size: a whole leaf call (a text
        encoder, the DiT), a recorded leaf method (``vae.encode``), a torch function, a
        tensor method.
    met by the first plan: a node run of the new plan whose node does what a node run of the
        first plan did (same op and target) on arguments of the same description (every
        tensor's shape, dtype and device; every plain value; other objects by class). This is
        generous on purpose: it counts runs the memos could not answer (a module whose state
        changed, a result the call memo cannot remake), so it bounds what any reuse of the
        first plan's work could save. Every other node run sees a shape or value the first
        plan never saw.
    outside node runs: the rest of the plan: the step's own Python under the tracer, the
        probes' bookkeeping, the cut, codegen, the signature.

The reuse ceiling is ``(met by the first plan) / (the new plan)``: a plan that reused the
first plan's work wherever its inputs are the same would still cost ``1 - ceiling`` of it.

In and out::

    new_plan_profile(step, example, other) -> dict   seconds per part, node runs per part
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from graphsplit.planning.meta import meta_interpreter

Batch = dict[str, Any] | tuple[Any, ...]
PARTS = ("met by the first plan", "new to this plan", "outside node runs")


def _as_call(batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ((), dict(batch)) if isinstance(batch, dict) else (tuple(batch), {})


def _described(interpreter: Any, node: Any) -> Any:
    """What the node runs and a description of its arguments (see the glossary)."""
    leaves, _ = tree_flatten(interpreter.fetch_args_kwargs_from_env(node))
    with torch._C.DisableTorchFunction():
        described = tuple(
            ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type)
            if isinstance(leaf, torch.Tensor)
            else leaf
            if leaf is None or isinstance(leaf, (bool, int, float, str))
            else type(leaf).__qualname__
            for leaf in leaves
        )
    return (node.op, str(node.target), described)


def _watching(on_run: Callable[[Any, Any, Callable[[], Any]], Any]) -> Callable[[], None]:
    """Route every node run through ``on_run(interpreter, node, run)``; returns the undo."""
    original = meta_interpreter.MetaInterpreter.run_on_meta

    def watched(self: Any, node: Any, *, record: bool) -> Any:
        return on_run(self, node, lambda: original(self, node, record=record))

    meta_interpreter.MetaInterpreter.run_on_meta = watched  # type: ignore[method-assign]

    def undo() -> None:
        meta_interpreter.MetaInterpreter.run_on_meta = original  # type: ignore[method-assign]

    return undo


def new_plan_profile(step: Any, example: Batch, other: Batch) -> dict[str, Any]:
    """Split ``step`` on ``example`` (noting what each node run of its plan did), then make the
    plan for ``other`` as the dispatcher makes it, timing each node run by part. A batch is
    the step's keyword arguments (a dict) or its positional ones (a tuple)."""
    import graphsplit

    met: set[Any] = set()

    def noted(interpreter: Any, node: Any, run: Callable[[], Any]) -> Any:
        met.add(_described(interpreter, node))
        return run()

    undo = _watching(noted)
    try:
        split = graphsplit.split(step, *_as_call(example))
    finally:
        undo()
    seconds = dict.fromkeys(PARTS, 0.0)
    counts = dict.fromkeys(PARTS[:2], 0)
    parts_of: dict[str, set[str]] = {}  # node target -> the parts its runs were classed in
    keying = [0.0]  # the profile's own descriptions: taken off the plan's time

    def timed(interpreter: Any, node: Any, run: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        part = PARTS[0] if _described(interpreter, node) in met else PARTS[1]
        parts_of.setdefault(str(node.target), set()).add(part)
        keying[0] += time.perf_counter() - started
        started = time.perf_counter()
        try:
            return run()
        finally:
            seconds[part] += time.perf_counter() - started
            counts[part] += 1

    undo = _watching(timed)
    try:
        started = time.perf_counter()
        plan = split.plan_set._make_plan(*_as_call(other))
        total = time.perf_counter() - started - keying[0]
    finally:
        undo()
    seconds[PARTS[2]] = total - seconds[PARTS[0]] - seconds[PARTS[1]]
    return {
        "plan_s": total,
        "plan_key": plan.key,
        "seconds": seconds,
        "node_runs": counts,
        "parts_by_target": {target: sorted(parts) for target, parts in parts_of.items()},
        "reuse_ceiling": seconds[PARTS[0]] / total,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.signature_profile CASE [--full-size] [--repeat N]``: print each
    repeat's profile of a new plan (a fresh split each time) as one JSON line."""
    import argparse
    import json

    from benchmarks.common import torch_threads

    command = argparse.ArgumentParser(prog="python -m benchmarks.signature_profile")
    command.add_argument(
        "case",
        help="a bench_signatures case, or with --full-size a "
        "bench_plan_scale case that has a second shape (sdxl, flux, wan)",
    )
    command.add_argument("--full-size", action="store_true", help="the model on meta at full size")
    command.add_argument("--repeat", type=int, default=3)
    args = command.parse_args(argv)
    if args.full_size:
        from benchmarks import bench_plan_scale

        step, example = bench_plan_scale.BUILDERS[args.case](1)
        other = bench_plan_scale.RESHAPED[args.case](example)
    else:
        from benchmarks.bench_signatures import CASES

        step, make_batch, shapes = CASES[args.case]()
        example, other = make_batch(shapes[0], 0), make_batch(shapes[1], 1)
    with torch_threads(1):
        for _ in range(args.repeat):
            row = new_plan_profile(step, example, other)
            print(json.dumps({"case": args.case, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
