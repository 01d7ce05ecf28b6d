"""The module-level path's stage 1 forks every generator around its run; what does that cost?

Stage 1 runs the user's step up to its last cached call, once per batch while caching, inside
:func:`graphsplit.calls.generators.forked` so that caching never moves the user's random
streams. Since the step's own ``torch.Generator`` objects are given back too, three forks can
run it, timed here in interleaved rounds on the same batch (one torch thread):

- ``known``: what stage 1 runs, ``forked(watch=False)``: the global generators and the step's
  own generators the probes saw, by their states alone;
- ``watched``: ``forked()`` with the ``OwnGenerators`` mode seeing every torch call (what the
  probes and ``verify`` run);
- ``globals``: the fork before the step's own generators were given back (global ones only).

One JSON line: per case the median of the same-round ratios ``known / globals`` and
``watched / globals`` with their IQR, on the CPU and the wall clock.

    python -m benchmarks.fork_profile --cases sd kd --rounds 30
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

CASE_NAMES = ("sd", "kd")


@contextlib.contextmanager
def _globals_only(*_: Any, **__: Any) -> Iterator[None]:
    """The fork before the step's own generators were given back."""
    import numpy as np
    import torch

    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def fork_profile(case_name: str, rounds: int) -> dict[str, Any]:
    import graphsplit
    from benchmarks.bench_calls_overhead import CASES
    from benchmarks.common import interleaved
    from graphsplit.calls import generators

    case = CASES[case_name]("tiny", 1)
    split = graphsplit.split(case.step, (), case.batches[0], path="calls")
    batch = case.batches[0]
    real = generators.forked
    forks = {
        "known": real,
        "watched": lambda *a, **k: real(),
        "globals": _globals_only,
    }

    def run(name: str) -> None:
        generators.forked = forks[name]
        try:
            split.stage1(**batch)
        finally:
            generators.forked = real

    timings = interleaved({name: (lambda name=name: run(name)) for name in forks}, rounds=rounds)
    row: dict[str, Any] = {"case": case_name, "rounds": rounds}
    for clock in ("cpu", "wall"):
        row[f"globals_{clock}_ms"] = 1e3 * timings.spread("globals", clock).median
        for name in ("known", "watched"):
            row[f"{name}_over_globals_{clock}"] = timings.ratio(name, "globals", clock).to_json()
    return row


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.fork_profile [--cases sd kd] [--rounds N]``: one JSON line."""
    import argparse
    import json

    from benchmarks.common import torch_threads

    command = argparse.ArgumentParser(prog="python -m benchmarks.fork_profile")
    command.add_argument("--cases", nargs="+", default=list(CASE_NAMES), choices=CASE_NAMES)
    command.add_argument("--rounds", type=int, default=30)
    args = command.parse_args(argv)
    with torch_threads(1):
        rows = [fork_profile(name, args.rounds) for name in args.cases]
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
