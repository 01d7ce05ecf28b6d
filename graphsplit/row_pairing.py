"""Does stage 2 pair rows of its batch by position? Poison one row at a time and watch.

A cache stores stage 1's boundary one row per sample, and its loader regroups and shuffles the
rows: right for a step that treats its batch as a set of samples, silently wrong for one that
pairs rows by where they stand. TRL's ``DataCollatorForPreference`` stacks ``[chosen;
rejected]`` and the DPO loss subtracts ``logps.chunk(2)``: row ``i`` is compared with row
``i + B``; shuffled, stage 2 compares a sample's chosen answer with another's rejected one.

Glossary:
    poisoned run: stage 2 on the example's boundary with one row of every per-row float tensor
        (along its batch dim) set to NaN. NaN spreads through every op that reads it (``0 *
        NaN`` is NaN), so an op's output row that turns NaN read that input row.
    meet: rows of the batch meet at an op where one of its output rows (along dim 0) turned
        NaN in the runs of each of them but not in every row's run. Reached from every row, it
        is a reduction over the batch (a mean loss, in-batch negatives, BatchNorm): regrouping
        changes which rows share a batch, as any shuffled loader does, and nothing else. Only
        ops that compute count: a view (a slice, a transpose) reads no row.
    by position: the rows that meet depend on where they stand, not on what they hold. With
        two rows swapped (one of a group that meets and one outside it; else one of the same
        group) other rows meet. Rows grouped by their values (a mean per label; a loss over the
        rows that have labels) meet alike in any order: a function of the batch as a set, which
        regrouping keeps.

Why NaN and not gradients: at a LoRA step's start (``B = 0``) a DPO loss is ``log 2`` and its
gradients are the same for any pairing of the rows, so no check by values can see the pairing;
NaN follows what each op reads, whatever the values.

What it cannot see (a pairing it misses is a silent wrong result, so each is in the docs):
rows that meet only through integer tensors (ids, labels), which have no NaN; an example of
fewer than three rows (two rows meet as the whole batch); a batch-wide mix before the pairing
(BatchNorm in train mode in stage 2, frozen or not); a step that guards against NaN
(``nan_to_num``, a branch that skips a NaN loss: its runs take other ops and are left out);
a model changed after ``split()`` so that the example no longer runs (``paired_rows`` is found
on first read). A pairing drawn at random inside the step (``x[torch.randperm(B)]``, mixup's
``x.flip(0)``) is reported: the runs share one seed, so it looks positional. It runs stage 1
once and stage 2 ``rows + 2`` times on the example, ``rows + 2`` more per swap where rows meet
(two swaps at most), on the first :data:`MAX_ROWS` rows, with autograd on as training runs it,
every buffer and attribute of the step put back and every generator forked.

In and out::

    find_paired_rows(stage1, stage2, boundary, args, kwargs, module, step) -> PairedRows | None
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from graphsplit.artifacts import BoundarySpec, PairedRows
from graphsplit.calls.generators import seeded
from graphsplit.planning.rules.user_lines import describe, frame_location_of, is_internal

__all__ = ["ELEMENTS_APART", "MAX_ROWS", "MIN_ROWS", "RUNS_KEPT", "find_paired_rows"]

# Two rows meet as the whole batch: no pairing can be told from a reduction below three.
MIN_ROWS = 3

# At most this many rows of the example are watched (the first ones): the runs grow with the
# rows, and a step's code pairs rows the same way in a smaller batch (chunk(2) of 12 rows pairs
# row i with i + 6). Divisible by 2, 3, 4 and 6: halves, thirds and groups of 4 stay whole.
MAX_ROWS = 12

# A step module's method whose context manager puts back what the runs change outside the
# module (a trainer's logged metrics: graphsplit.integrations.trainer_loss.TrainerLoss).
RUNS_KEPT = "graphsplit_runs_kept"

# Up to this many elements an output is watched element by element, above it row by row: a
# batch dim moved off dim 0 (``scores.view(2, -1)``) is still told apart where losses are made.
ELEMENTS_APART = 4096

# One run's record: per output tensor of each op, in order, its name and which of its parts hold
# a NaN (:func:`_nan_rows`; None for an output that is no float tensor).
Marks = list[tuple[str, torch.Tensor | None]]


class _RowMarks(TorchDispatchMode):
    """Records, for each op's float outputs, which parts hold a NaN (:func:`_nan_rows`); with
    ``stop``, also the user's line of the output at that position."""

    def __init__(self, stop: int | None = None) -> None:
        super().__init__()
        self.marks: Marks = []
        self.stop = stop
        self.source = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if self.stop is not None and len(self.marks) == self.stop and not self.source:
                self.source = _user_source()
            # A view reads nothing: what it shows is its base's memory, which may hold what no
            # row of this run wrote (a scratch buffer's leftovers, memory the allocator hands
            # back from a freed NaN tensor, as in TRL's chunked log-prob kernel).
            self.marks.append((func.__name__, None if func.is_view else _nan_rows(leaf)))
        return out


def _nan_rows(value: Any) -> torch.Tensor | None:
    """Which parts of ``value`` hold a NaN: each element of a small tensor (a loss's per-row
    scores, a number, a table whose rows are groups of the batch's), each row along dim 0 of a
    larger one (activations, whose rows are the batch's)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    if not (value.is_floating_point() or value.is_complex()) or value.device.type == "meta":
        return None
    if value.numel() == 0:
        return None
    if value.numel() <= ELEMENTS_APART:
        return value.isnan().reshape(-1).cpu()
    return value.isnan().reshape(value.shape[0], -1).any(dim=1).cpu()


def _user_source() -> str:
    """``file:line  code`` of the innermost frame outside torch and graphsplit (an installed
    library's, like TRL's loss, counts: it is where the rows meet); in a generated stage
    (torch.fx code), the traced node's own line."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<eval_with_key"):
            source = _node_source(frame.f_locals.get("self"), frame.f_lineno)
            if source:
                return source
        elif not is_internal(filename):
            return describe(frame_location_of(filename, frame.f_lineno))
        frame = frame.f_back
    return ""


def _node_source(module: Any, line: int) -> str:
    """The source graphsplit's trace recorded on the fx node at ``line`` of ``module``'s code."""
    lines = getattr(module, "_lineno_map", None)
    graph = getattr(module, "graph", None)
    if not isinstance(lines, dict) or not isinstance(graph, fx.Graph):
        return ""
    index = lines.get(line - getattr(module, "_prologue_start", 0))
    nodes = list(graph.nodes)
    if index is None or not 0 <= index < len(nodes):
        return ""
    node = nodes[index]
    place = node.meta.get("source")
    known = place and place != "<unknown>"
    return describe((place, node.meta.get("source_code", ""))) if known else ""


def find_paired_rows(
    stage1: Callable[..., Any],
    stage2: Callable[..., Any],
    boundary: Mapping[str, BoundarySpec],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    module: nn.Module | None,
    step: Any = None,
) -> PairedRows | None:
    """Where stage 2 pairs rows of the example batch by position, or None (also when it cannot
    tell: fewer than :data:`MIN_ROWS` rows, no per-row float tensor, a run that fails).

    ``module`` is the step module the stages were made from, ``step`` the step as the user
    gave it (its :data:`RUNS_KEPT` context, if any, wraps the runs)."""
    if module is not None and any(
        t.device.type == "meta" for t in (*module.parameters(), *module.buffers())
    ):
        return None  # planned on meta (a model too large to load): nothing runs for real
    try:
        with _attributes_kept(module, stage1, stage2), _runs_kept(step, module):
            return _paired_rows(stage1, stage2, boundary, args, kwargs, module)
    except Exception:  # a check must never fail the cache() that reads it: cannot tell
        return None


def _paired_rows(
    stage1: Callable[..., Any],
    stage2: Callable[..., Any],
    boundary: Mapping[str, BoundarySpec],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    module: nn.Module | None,
) -> PairedRows | None:
    run = _Runner(stage2, module, stage1)
    try:
        # On copies: a step may write its batch in place (Whisper's SpecAugment masks spans).
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, dict(kwargs)))
        with run.buffers_kept(), seeded(0), torch.no_grad():
            values = stage1(*args, **kwargs)
    except Exception:  # the split's own checks (verify, caching) report a stage that fails
        return None
    if not isinstance(values, Mapping):
        return None
    every_row_at = _row_dims(values, boundary)
    rows_at = {n: d for n, d in every_row_at.items() if values[n].is_floating_point()}
    sizes = {values[name].shape[dim] for name, dim in every_row_at.items()}
    if len(sizes) != 1 or (rows := sizes.pop()) < MIN_ROWS or not rows_at:
        return None
    if rows > MAX_ROWS:  # the step's code pairs rows, not its data: fewer rows show it alike
        values = {
            name: value.narrow(every_row_at[name], 0, MAX_ROWS) if name in every_row_at else value
            for name, value in values.items()
        }
        rows = MAX_ROWS
    meets = _meetings(run, values, rows_at, rows, list(range(rows)))
    if meets is None:
        return None
    for order in _swaps(meets, rows):  # position p holds the example's row order[p]
        reordered = {
            name: value.index_select(every_row_at[name], torch.tensor(order, device=value.device))
            if name in every_row_at
            else value
            for name, value in values.items()
        }
        first = _first_difference(meets, _meetings(run, reordered, rows_at, rows, order))
        if first is not None:
            index, groups = first
            return PairedRows(
                op=meets[index][0],
                source=run.source_of(values, index),
                groups=tuple(sorted(tuple(sorted(group)) for group in groups)),
                rows=rows,
            )
    return None  # the same rows meet in any order: a function of the batch as a set


@contextlib.contextmanager
def _attributes_kept(*owners: Any) -> Iterator[None]:
    """Every module's attributes as they were: the runs may set them (a rotary table cached
    as a tensor attribute, a counter) or add to them (a list of past losses, which would hold
    the runs' NaN), and a split must leave the step as it found it. Lists, dicts and sets are
    refilled in place and plain tensor attributes copied back, the objects kept."""
    modules = {
        id(m): m for owner in owners if isinstance(owner, nn.Module) for m in owner.modules()
    }
    saved = [(m, dict(vars(m))) for m in modules.values()]
    contents = [
        (value, _contents(value))
        for _, attributes in saved
        for name, value in attributes.items()
        if name not in _MODULE_TABLES and _contents(value) is not None
    ]
    try:
        yield
    finally:
        for m, attributes in saved:
            current = vars(m)
            for name in [name for name in current if name not in attributes]:
                del current[name]
            current.update(attributes)
        for value, content in contents:
            with contextlib.suppress(Exception):  # never an error of graphsplit's own here
                _refill(value, content)


# The module's own tables of parameters, buffers and submodules: put back by their buffers'
# copies (_Runner) and by identity, never refilled.
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


def _contents(value: Any) -> Any:
    """A copy of what a list, dict, set or plain tensor holds; None for anything else."""
    if type(value) in (list, dict, set, collections.OrderedDict):  # not a library's subclass
        return copy.copy(value)
    if type(value) is torch.Tensor and not value.is_inference() and value.device.type != "meta":
        return value.detach().clone()
    return None


def _refill(value: Any, content: Any) -> None:
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            if value.shape == content.shape and value.dtype == content.dtype:
                value.copy_(content)
        return
    value.clear()
    if isinstance(value, list):
        value.extend(content)
    else:
        value.update(content)


@contextlib.contextmanager
def _runs_kept(step: Any, module: nn.Module | None) -> Iterator[None]:
    """Every :data:`RUNS_KEPT` context of the step as the user gave it (a module, or a bound
    method: its owner) and of the step module's modules, each once."""
    owners = [step, getattr(step, "__self__", None)]
    owners += list(module.modules()) if module is not None else []
    with contextlib.ExitStack() as stack:
        for each in {id(o): o for o in owners if o is not None}.values():
            kept = getattr(type(each), RUNS_KEPT, None)
            if callable(kept):
                stack.enter_context(kept(each))
        yield


def _row_dims(values: Mapping[str, Any], boundary: Mapping[str, BoundarySpec]) -> dict[str, int]:
    """The per-row tensors of stage 1's outputs, by name, and their batch dims."""
    return {
        name: spec.batch_dim
        for name, spec in boundary.items()
        if spec.batch_dim is not None
        and isinstance(values.get(name), torch.Tensor)
        and values[name].device.type != "meta"
        and values[name].dim() > spec.batch_dim
    }


# Ops whose output holds whatever memory held: a NaN there is no input's.
_UNSET = ("empty", "new_empty", "_empty")

# Per op output: the groups of example rows (by the example's numbering) that meet there.
Meetings = list[tuple[str, frozenset[frozenset[int]]]]


def _meetings(
    run: _Runner,
    values: Mapping[str, Any],
    rows_at: Mapping[str, int],
    rows: int,
    order: list[int],
) -> Meetings | None:
    """Stage 2 once as is and once per row poisoned: per op output, the groups of two or more
    rows (not all) that reach one of its rows; None where no group forms or the runs fail."""
    # The first run of a step may do work once (a lazily built table): twice, the second kept.
    base = run(values) and run(values)
    if base is None:
        return None
    names = [name for name, _ in base]
    poisoned: dict[int, Marks] = {}
    for position in range(rows):
        marks = run(_poisoned(values, rows_at, position))
        # A run that NaN steered elsewhere (another op sequence) does not line up: left out.
        if marks is not None and [name for name, _ in marks] == names:
            poisoned[order[position]] = marks
    if len(poisoned) < MIN_ROWS:
        return None
    every = frozenset(poisoned)
    meetings: Meetings = []
    found = False
    for index, (name, seen) in enumerate(base):
        groups: set[frozenset[int]] = set()
        if seen is not None and not name.startswith(_UNSET):
            reached: dict[int, set[int]] = {}
            for row, marks in poisoned.items():
                mark = marks[index][1]
                if mark is None or mark.shape != seen.shape:
                    continue
                for output_row in torch.nonzero(mark & ~seen).flatten().tolist():
                    reached.setdefault(output_row, set()).add(row)
            groups = {frozenset(g) for g in reached.values() if len(g) >= 2 and g != every}
        found = found or bool(groups)
        meetings.append((name, frozenset(groups)))
    return meetings if found else None


def _swaps(meets: Meetings, rows: int) -> Iterator[list[int]]:
    """The rows in their order but for two swapped, twice: the first row of the first group
    that meets with the first row outside the group (the group loses a member for another),
    then with another row of the group (the other groups it meets in change: every chosen row
    against every rejected one). Rows grouped by what they hold meet alike under both."""
    group = next(min(groups, key=min) for _, groups in meets if groups)
    inside = min(group)
    for other in (min(set(range(rows)) - group), max(group)):
        order = list(range(rows))
        order[inside], order[other] = other, inside
        yield order


def _first_difference(
    meets: Meetings, moved: Meetings | None
) -> tuple[int, frozenset[frozenset[int]]] | None:
    """The first op output whose meeting rows differ with the rows reordered, and its groups
    in the example's order; None where every group is the same in both orders."""
    for index, (_, groups) in enumerate(meets):
        if not groups:
            continue
        if moved is None or index >= len(moved) or moved[index][1] != groups:
            return index, groups
    return None


def _poisoned(
    values: Mapping[str, Any], rows_at: Mapping[str, int], position: int
) -> dict[str, Any]:
    out = dict(values)
    for name, dim in rows_at.items():
        copy = values[name].clone()
        copy.select(dim, position).fill_(float("nan"))
        out[name] = copy
    return out


class _Runner:
    """Runs stage 2 on boundary values under :class:`_RowMarks`, from one seed of every
    generator, with the inputs copied and every buffer it writes put back after."""

    def __init__(
        self, stage2: Callable[..., Any], module: nn.Module | None, stage1: Any = None
    ) -> None:
        self.stage2 = stage2
        owners = [m for m in (stage2, module, stage1) if isinstance(m, nn.Module)]
        self.buffers = list(
            {id(b): b for m in owners for b in m.buffers() if not b.is_inference()}.values()
        )

    def __call__(self, values: Mapping[str, Any], stop: int | None = None) -> Marks | None:
        watch = self._run(values, _RowMarks(stop))
        return None if watch is None else watch.marks

    def source_of(self, values: Mapping[str, Any], index: int) -> str:
        """The user's line of the op output at ``index``, from one more run as is."""
        watch = self._run(values, _RowMarks(index))
        return "" if watch is None else watch.source

    def _run(self, values: Mapping[str, Any], watch: _RowMarks) -> _RowMarks | None:
        try:
            with (
                self.buffers_kept(),
                seeded(0),
                torch.enable_grad(),
                # A compiled module runs its Python (dynamo would trace the recording mode).
                torch.compiler.set_stance("force_eager"),
                watch,
            ):
                self.stage2(**_copied(values))
        except Exception:  # a step that refuses NaN (an index from a float): not seen
            return None
        return watch

    @contextlib.contextmanager
    def buffers_kept(self) -> Iterator[None]:
        # Every one, whatever its version says: BatchNorm's kernel writes its running
        # statistics without counting a version.
        kept = [(b, b.detach().clone()) for b in self.buffers]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, copy in kept:
                    buffer.copy_(copy)


def _copied(values: Mapping[str, Any]) -> dict[str, Any]:
    """Stage 2's inputs as the cache hands them: detached copies a run may write."""
    return {
        name: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for name, value in values.items()
    }
