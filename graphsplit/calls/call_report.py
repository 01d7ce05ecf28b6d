""":class:`CallSplit`, a module-level split, with what the rest of graphsplit reads of a split.

``cache()``, :class:`~graphsplit.CachedDataset` and :func:`~graphsplit.verify` read a split's
``stage1`` / ``stage2`` / ``boundary`` / ``input_names`` / ``trainable`` (and ``plan_set``,
None here: a module-level plan holds for every batch shape). ``report()`` says which path the
split took and why, and each frozen call's verdict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from graphsplit.artifacts import BoundarySpec, PairedRows, PairedRowsOnDemand
from graphsplit.calls.call_plan import CallPlan
from graphsplit.calls.verdicts import every_call_cached
from graphsplit.units import human_bytes


@dataclass
class CallSplit(PairedRowsOnDemand):
    """A training step split at frozen module calls (the module-level path).

    ``split.stage2(**split.stage1(*args, **kwargs))`` returns what ``model(*args, **kwargs)``
    returns, with the same random draws and gradients: stage 2 runs the step's own code with
    the cached calls answered from stage 1's outputs. ``path`` is ``"calls"``; ``reason`` is
    why the whole-step trace was not used (its refusal, when ``split`` fell back).
    """

    stage1: nn.Module
    stage2: nn.Module
    boundary: dict[str, BoundarySpec]
    input_names: tuple[str, ...]
    trainable: frozenset[str]
    plan: CallPlan = field(repr=False)
    batch_sizes: tuple[int, int] = (0, 0)
    model_name: str = ""
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    path: str = "calls"
    _model: nn.Module | None = field(default=None, repr=False)
    plan_set: None = field(default=None, repr=False)
    # Where stage 2 pairs rows of its batch by position (the ``paired_rows`` property, found
    # on first read): a cache of it is read in whole batches.
    _paired_rows: PairedRows | None = field(default=None, repr=False)
    _find_paired_rows: Callable[[], PairedRows | None] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def plans(self) -> list[Any]:
        """A module-level split has no shape plans: one plan holds for every batch."""
        return []

    @property
    def signatures(self) -> list[Any]:
        return []

    def report(self) -> str:
        """Which path was taken and why, the boundary, and each frozen call's verdict."""
        lines = [f"graphsplit plan for {self.model_name} (module-level path)"]
        if self.reason:
            lines.append("path: calls, because the whole-step trace refused the step:")
            lines += ["    " + line for line in self.reason.splitlines()]
        else:
            lines.append('path: calls (asked for with path="calls")')
        per_sample = sum(spec.bytes_per_sample for spec in self.boundary.values())
        lines.append(
            f"boundary: {len(self.boundary)} tensors, {human_bytes(per_sample)} per sample"
        )
        for spec in self.boundary.values():
            shape = "x".join(str(size) for size in spec.shape) or "scalar"
            dtype = str(spec.dtype).removeprefix("torch.")
            lines.append(f"  {spec.name:<48} {shape:<16} {dtype:<9} {spec.source}")
        if self.plan.not_stored:
            unread = sum(spec.bytes_per_sample for spec in self.plan.not_stored.values())
            shapes = sum(self.boundary[key].bytes_per_sample for key in self.plan.shape_keys)
            lines.append(
                f"not stored (stage 2 never reads them): {len(self.plan.not_stored)} output "
                f"fields, {human_bytes(unread)} per sample; storing every field would take "
                f"{human_bytes(per_sample - shapes + unread)} per sample"
            )
        lines.append("frozen module calls:")
        lines += [verdict.line() for verdict in self.plan.verdicts]
        lines.append(
            f"stage 1 holds {_count(self.stage1)}; stage 2 holds {_count(self.stage2)} "
            "and runs the step's own Python (a module the step compiled runs compiled)."
        )
        placed = self.plan.placed
        if self.plan.dropped - placed:
            dropped = ", ".join(sorted(self.plan.dropped - placed))
            lines.append(
                "answered from the cache in stage 2 (weights not held, may stay on meta): "
                + dropped
            )
        if placed:
            lines.append(
                "not held by stage 2, but the step reads their weights' .device there (to "
                "place data): build them on the training device, not on meta: "
                + ", ".join(sorted(placed))
            )
        if self.plan.unused:
            unused = ", ".join(sorted(self.plan.unused))
            lines.append(
                "not held by stage 2 (the step computes with none of their weights there): "
                + unused
            )
        held = held_though_cached(self.plan)
        if held:
            lines.append(
                "held by stage 2 though every call is answered from the cache (the step "
                "computes with or converts their weights outside those calls, e.g. "
                "module.half() in the step): " + ", ".join(held)
            )
        if self.paired_rows is not None:
            lines += self.paired_rows.report_lines()[1:]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data (what :meth:`save_code` writes to ``plan.json``)."""
        return {
            "path": self.path,
            "reason": self.reason,
            "model": self.model_name,
            "inputs": list(self.input_names),
            "boundary": [spec.to_json() for spec in self.boundary.values()],
            "calls": [
                {"module": v.path, "index": v.index, "verdict": v.verdict.value, "detail": v.detail}
                for v in self.plan.verdicts
            ],
            "not_stored": list(self.plan.not_stored),
            "dropped": sorted(self.plan.dropped),
            "unused": sorted(self.plan.unused),
            "held_though_cached": held_though_cached(self.plan),
            "paired_rows": None if self.paired_rows is None else self.paired_rows.to_json(),
        }

    def save_code(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``plan.json`` (a module-level split generates no stage code: stage 2 is the
        step's own code)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return folder


def held_though_cached(plan: CallPlan) -> list[str]:
    """Modules all of whose calls are cached (and none inside them runs in stage 2) that stage 2
    holds anyway: the step computes with their weights elsewhere, or moves them (``.to``)."""
    return sorted(
        path
        for path in every_call_cached(plan.verdicts)
        if not any(path == held or path.startswith(held + ".") for held in plan.not_held)
    )


def _count(stage: nn.Module) -> str:
    params = list(stage.parameters())
    size = sum(p.numel() * p.element_size() for p in params)
    return f"{len(params)} parameter tensors ({human_bytes(size)})"
