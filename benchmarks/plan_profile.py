"""Where a ``split()`` spends its time: cumulative seconds of the planner's phases under cProfile.

Glossary:
    phase: a planner function whose cumulative time (its own and everything it calls) is one
        row: the trace, the analysis probes, the cut, codegen, and inside them the meta runs,
        the call memo's keys and the op memo. Phases nest and overlap (the trace's meta runs
        are inside the trace), so the rows do not add up; each is a share of the whole call.
    module run: the cumulative time of a frozen or trainable component's own code (a VAE's
        ``encode``, a text encoder's ``forward``) wherever it ran (trace or probes).
    profiled seconds: time under cProfile, which adds a roughly constant cost per Python call,
        so a phase of many small calls looks larger than it is unprofiled. The shares are what
        a reader compares; the unprofiled total is measured beside them.

In and out:
    phase_profile(call, components) -> list[dict]   one row per phase with seconds and share
    profile_table(rows) -> str                      a markdown table of those rows
"""

from __future__ import annotations

import cProfile
import inspect
import pstats
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks.common import markdown_table

# (label, file suffix, function name): graphsplit's phases, outermost first.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("the plan (`_Planner.plan`)", "graphsplit/api.py", "plan"),
    ("trace + analysis (`trace_and_analyze`)", "planning/leaf_rounds.py", "trace_and_analyze"),
    ("· the fx trace (`trace_step`)", "planning/tracing/tracer.py", "trace_step"),
    ("· the analysis probes (`node_facts.analyze`)", "planning/analyse/node_facts.py", "analyze"),
    ("· nodes' meta runs (`run_on_meta`)", "planning/meta/meta_interpreter.py", "run_on_meta"),
    ("· call memo: module calls (`replay_or_call_module`)", "planning/meta/call_memo.py",
     "replay_or_call_module"),
    ("· call memo: keys (`_call_signature` + `_node_signature`)", "planning/meta/call_memo.py",
     "_call_signature|_node_signature"),
    ("· op memo: dispatch (`OpMemo.__torch_dispatch__`)", "planning/meta/op_memo.py",
     "__torch_dispatch__"),
    ("· op records (`OpRecorder.__torch_dispatch__`)", "planning/meta/op_recorder.py",
     "__torch_dispatch__"),
    ("cut (`choose_boundary`)", "planning/cut/boundary.py", "choose_boundary"),
    ("codegen, stage 1 (`build_stage1`)", "planning/codegen/stages.py", "build_stage1"),
    ("codegen, stage 2 (`build_stage2`)", "planning/codegen/stages.py", "build_stage2"),
)  # fmt: skip
METHODS = ("forward", "encode")  # a component's entry points counted as its module run


def phase_profile(
    call: Callable[[], Any], components: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Run ``call()`` (one ``split()``) under cProfile; one row per phase, then per component.

    ``components`` maps a name to a module whose ``forward`` / ``encode`` (its class's own
    code) is reported as that component's module run.
    """
    profile = cProfile.Profile()
    profile.enable()
    try:
        call()
    finally:
        profile.disable()
    profiled = pstats.Stats(profile)
    stats = profiled.stats  # type: ignore[attr-defined]
    total = profiled.total_tt or 1e-9  # type: ignore[attr-defined]
    rows = [{"phase": "the whole call", "seconds": total}]
    rows += [
        {"phase": label, "seconds": _cumulative(stats, suffix, names)}
        for label, suffix, names in PHASES
    ]
    for name, module in (components or {}).items():
        seconds = 0.0
        for method in METHODS:
            function = inspect.unwrap(getattr(type(module), method, None) or _no_method)
            code = getattr(function, "__code__", None)
            if code is None or function is _no_method:
                continue
            found = _cumulative(stats, code.co_filename, method, line=code.co_firstlineno)
            seconds = max(seconds, found)
        label = f"module run: `{name}` ({type(module).__name__})"
        rows.append({"phase": label, "seconds": seconds})
    for row in rows:
        row["share"] = row["seconds"] / total
    return rows


def _no_method() -> None:
    """Stands for a method a component lacks."""


def _cumulative(stats: dict, suffix: str, names: str, line: int | None = None) -> float:
    """The largest cumulative time among functions named one of ``names`` in a file ending in
    ``suffix`` (the outermost call of a recursive function holds the whole of it); the sum over
    several names."""
    wanted = set(names.split("|"))
    best: dict[str, float] = {}
    for (filename, lineno, function), (_, _, _, cumulative, _) in stats.items():
        if function not in wanted or not filename.endswith(suffix):
            continue
        if line is not None and lineno != line:
            continue
        best[function] = max(best.get(function, 0.0), cumulative)
    return sum(best.values())


def profile_table(rows: list[dict[str, Any]]) -> str:
    """The rows as ``| phase | profiled s | share of the call |``."""
    cells = [[row["phase"], f"{row['seconds']:.3f}", f"{row['share']:.0%}"] for row in rows]
    return markdown_table(["phase", "profiled s", "share of the call"], cells, "lrr")
