"""``graphsplit.split``: wire the planning steps, and the :class:`Split` they produce.

The steps, each one module of :mod:`graphsplit.planning` (see its docstring for the glossary)::

    bind_examples (inputs) -> trace_and_analyze (rounds: trace, codecs, analyze)
        -> choose_boundary (cut) -> build_stage1 / build_stage2 (codegen) -> Split

Each hands the next a typed artifact from :mod:`graphsplit.artifacts`.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import BoundarySpec, Cut, PairedRows, PairedRowsOnDemand
from graphsplit.calls import CallSplit, generators, split_calls
from graphsplit.calls.unfrozen import NOTHING_FROZEN_FIX
from graphsplit.errors import Fix, SplitError, TraceError, user_error
from graphsplit.planning.codegen.compiled_calls import compiled_code_notes
from graphsplit.planning.codegen.stages import build_stage1, build_stage2, standalone_source
from graphsplit.planning.cut.ambient_dtypes import refuse_read_dtypes, with_run_dtypes
from graphsplit.planning.cut.boundary import boundary_specs, choose_boundary
from graphsplit.planning.cut.recompute import Recompute, check_recompute
from graphsplit.planning.leaf_rounds import trace_and_analyze
from graphsplit.planning.meta.shared_memos import SharedMemos, sharing
from graphsplit.planning.patching.patcher import one_planning_at_a_time
from graphsplit.planning.rules.constant_sizes import guard_constant_sizes
from graphsplit.planning.step.callables import as_step_module
from graphsplit.planning.step.example_inputs import bind_examples
from graphsplit.planning.step.frozen import FrozenSpec, resolve_frozen
from graphsplit.planning.step.ragged_lists import refuse_ragged_lists
from graphsplit.planning.tracing.int_calls import INT_SITES
from graphsplit.planning.tracing.rewrites import restore_devices
from graphsplit.planning.tracing.weight_constants import refuse_weight_constants
from graphsplit.report import plan_json, render_report
from graphsplit.row_pairing import find_paired_rows
from graphsplit.signatures.defaults import defaults_taken
from graphsplit.signatures.dispatch import DEFAULT_MAX_PLANS, Plan, PlanSet
from graphsplit.signatures.signature import Signature, example_record, signature_of


@dataclass
class Split(PairedRowsOnDemand):
    """The two stages of a training step, and the plan that produced them.

    ``split.stage2(**split.stage1(*args, **kwargs))`` returns what ``model(*args, **kwargs)``
    returns, with the same random draws and the same gradients on the same parameters.
    """

    stage1: fx.GraphModule
    stage2: fx.GraphModule
    boundary: dict[str, BoundarySpec]
    input_names: tuple[str, ...]
    trainable: frozenset[str]
    graph: fx.Graph = field(repr=False)
    cut: Cut = field(repr=False)
    batch_sizes: tuple[int, int] = (0, 0)
    model_name: str = ""
    notes: list[str] = field(default_factory=list)
    _model: nn.Module | None = field(default=None, repr=False)
    # Which path made the split: "trace" (this class) or "calls" (graphsplit.calls.CallSplit).
    path: str = "trace"
    # The plans by signature, and the dispatch between them (graphsplit.signatures.dispatch).
    plan_set: PlanSet | None = field(default=None, repr=False)
    # Where stage 2 pairs rows of its batch by position (the ``paired_rows`` property, found
    # on first read): a cache of it is read in whole batches.
    _paired_rows: PairedRows | None = field(default=None, repr=False)
    _find_paired_rows: Callable[[], PairedRows | None] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def plans(self) -> list[Plan]:
        """Every plan made so far, the first (``stage1``, ``stage2``) first."""
        return list(self.plan_set.plans.values()) if self.plan_set else []

    @property
    def signatures(self) -> list[Signature]:
        """The signature of each plan made so far (what its size checks expect)."""
        return [plan.signature for plan in self.plans]

    def report(self) -> str:
        """The plan for a human: boundary, parameters per stage, FLOPs moved, random ops."""
        return render_report(self, self._model)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data (what :meth:`save_code` writes to ``plan.json``)."""
        return plan_json(self)

    def save_code(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``stage1.py``, ``stage2.py`` (the generated source) and ``plan.json``.

        Each stage file runs on its own: ``Stage1(split.stage1)`` (``Stage2(...)``) is a module
        holding the same objects as the live stage, with the generated ``forward``.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, stage in (("stage1", self.stage1), ("stage2", self.stage2)):
            class_name = name.capitalize()
            header = (
                f'"""{name} of {self.model_name}, generated by graphsplit.\n\n'
                f"``{class_name}(split.{name})`` holds the live stage's objects (the model's own\n"
                f"modules and parameters) and computes what ``split.{name}`` computes.\n"
                '"""'
            )
            (folder / f"{name}.py").write_text(standalone_source(stage, class_name, header))
        (folder / "plan.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return folder


SplitPath = Literal["auto", "trace", "calls"]
"""Which path :func:`split` takes (see its ``path`` argument)."""
PATHS: tuple[str, ...] = get_args(SplitPath)


@one_planning_at_a_time  # the trace patches the process: concurrent splits wait (patcher.py)
def split(
    model: nn.Module | Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    frozen: FrozenSpec = None,
    recompute: Recompute = "never",
    max_plans: int = DEFAULT_MAX_PLANS,
    path: SplitPath = "auto",
) -> Split | CallSplit:
    """Split a training step (raw batch -> loss) into a cacheable stage 1 and a training stage 2.

    Args:
        model: what runs the whole step and returns the loss (or a tuple / dict of outputs):
            a module (its ``forward``), or a plain function, closure or bound method. The
            modules a function reaches (closure cells, the globals it loads, ``self``'s
            attributes, arguments that are modules) are found automatically and named as the
            code names them (``unet.*``); stage 2 calls those same objects. Module arguments
            are bound once: ``stage1`` takes the rest of the batch.
        args, kwargs: an example batch. Tensors whose first dim equals the first tensor's are
            batched along dim 0; other tensors are per-dataset constants. Only shapes, dtypes
            and devices are read: values are never looked at.
        frozen: which parameters are frozen. ``None``: those with ``requires_grad=False``.
            Also a predicate ``(name, param) -> bool``, modules, or qualified-name prefixes.
        recompute: ``"never"`` (default): all frozen work stays in stage 1, so a stage-2
            process may build every frozen module on ``meta``. ``"auto"``: stage 2 may redo a
            frozen layer whose inputs it has anyway (a LoRA'd layer's base projection, an
            embedding lookup) when the cache bytes per sample saved outweigh the FLOPs and the
            frozen weights stage 2 must then hold; ``report()`` shows the trade. Both paths:
            the module-level path redoes such a layer's cached calls (verdict
            ``recomputed``), and with ``"never"`` its report says what ``"auto"`` would save.
        max_plans: how many plans the split may make. Where the step turns a size or a value
            read from frozen data into a Python constant (``int(width * 8)``, ``if
            h.shape[-1] % 16``, ``.tolist()``), a plan holds for one value of it; a batch with
            another value gets a plan of its own, made from that batch when it first comes
            (``split.plans``, ``split.signatures``). Sizes that only flow through torch ops
            never need one. A batch that would need plan ``max_plans + 1`` is a SplitError
            naming the values that vary and the lines that read them.

        path: which path splits the step. ``"trace"``: the whole-step trace (a cut anywhere in
            the step's graph, stage 2 generated code). ``"calls"``: the module-level path
            (:mod:`graphsplit.calls`): the outputs of frozen module calls whose inputs are a
            function of the sample alone are cached, and stage 2 runs the step's own Python
            with those calls answered from the cache. ``"auto"`` (default): the trace, and
            where it refuses the step, the module-level path; ``report()`` says which path was
            taken and why.

    Returns:
        :class:`Split` with ``stage1``, ``stage2``, ``boundary``, ``report()``, ``save_code()``;
        a :class:`~graphsplit.calls.CallSplit` (the same methods) from the module-level path.

    Raises:
        TraceError: the step cannot be traced for every batch (control flow on tensor values,
            randomness drawn at trace time, batch-size-dependent Python control flow).
        SplitError: no exact split exists (a non-tensor value without codec must cross), or
            ``model`` is a callable graphsplit cannot trace (a class, a builtin, a generator).

    Example:
        >>> import torch, graphsplit
        >>> class Step(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.encoder = torch.nn.Linear(8, 4).requires_grad_(False)
        ...         self.head = torch.nn.Linear(4, 1)
        ...     def forward(self, x, y):
        ...         return torch.nn.functional.mse_loss(self.head(self.encoder(x)), y)
        >>> step, x, y = Step(), torch.randn(3, 8), torch.randn(3, 1)
        >>> parts = graphsplit.split(step, (x, y))
        >>> list(parts.boundary)
        ['y', 'encoder']
        >>> torch.equal(parts.stage2(**parts.stage1(x, y)), step(x, y))
        True
    """
    check_recompute(recompute)
    if path not in PATHS:
        raise user_error(
            SplitError,
            f"path={path!r} is not a path graphsplit.split knows.",
            fix=Fix('pass path="auto" (default), "trace" or "calls"'),
        )
    refuse_ragged_lists(model, args, kwargs)  # neither path lines a per-sample list up
    made = _split_on(model, args, kwargs, frozen, recompute, max_plans, path)
    # A cache's loader regroups rows: a step that pairs them by position must keep its
    # batches. Found when first asked (by cache(), report()), on this example.
    step = as_step_module(model, args, dict(kwargs or {}))
    made._find_paired_rows = functools.partial(
        find_paired_rows,
        made.stage1,
        made.stage2,
        made.boundary,
        step.args,
        step.kwargs,
        step.module,
        model,
    )
    return made


def _split_on(
    model: nn.Module | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    frozen: FrozenSpec,
    recompute: Recompute,
    max_plans: int,
    path: SplitPath,
) -> Split | CallSplit:
    """The split of the path asked for; ``"auto"``: the trace's, or the module-level path's
    where the trace refuses or keeps a frozen module whole."""
    if path == "calls":
        return split_calls(model, args, kwargs, frozen=frozen, recompute=recompute)
    if path == "trace":
        return _split_traced(model, args, kwargs, frozen, recompute, max_plans)
    try:
        traced = _split_traced(model, args, kwargs, frozen, recompute, max_plans)
    except (TraceError, SplitError) as refusal:
        try:
            return split_calls(
                model,
                args,
                kwargs,
                frozen=frozen,
                reason=_whole_message(refusal),
                recompute=recompute,
            )
        except Exception as calls_refusal:  # the step may not even run eagerly (meta weights)
            if getattr(calls_refusal, "fix", None) is NOTHING_FROZEN_FIX:
                # Nothing to cache by any path: that, not the trace's complaint, comes first.
                calls_refusal.add_note(
                    f"(the whole-step trace refused it too: {_whole_message(refusal)})"
                )
                raise calls_refusal from refusal
            why = getattr(calls_refusal, "reason", None) or str(calls_refusal)
            fix = getattr(calls_refusal, "fix", None)
            refusal.add_note(
                'graphsplit also tried the module-level path (path="calls"), which refused '
                f"too: {why}" + (f"\n  it suggests: {fix.words}" if isinstance(fix, Fix) else "")
            )
            raise refusal from calls_refusal
    return prefer_calls_over_kept_whole(
        traced, model, args, kwargs, frozen=frozen, recompute=recompute
    )


def prefer_calls_over_kept_whole(
    traced: Split,
    model: nn.Module | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    *,
    frozen: FrozenSpec,
    recompute: Recompute,
) -> Split | CallSplit:
    """``path="auto"``: the trace's split, or the module-level path's where the trace kept a
    module whole because tracing into it failed or found no valid cut inside it, stage 2
    holds frozen weights of it for that reason alone, and the module-level path holds fewer
    frozen bytes in stage 2 (Gemma 3's ``Gemma3Model``, whose vmapped mask fx cannot trace:
    the trace ran the frozen vision tower every step, the module-level path caches its call;
    ``BertForMultipleChoice``, whose BERT runs on batch x choices rows the trace cannot cut
    per sample, cached four rows a sample by the module-level path).

    Only that typed signal (``Plan.kept_whole``) opens the comparison: a trace plan that
    caches nothing is often the min-cut's own right choice (ids are cheaper than their
    embeddings), so "caches nothing" alone says nothing. The module-level split must also run
    stage 2 on its own stage 1's output of the example: its probes see real tensors, and a
    step that checks ``type(x) is torch.Tensor`` would refuse the stand-in of an unstored input.
    """
    kept = traced.plan_set.first.kept_whole if traced.plan_set is not None else frozenset()
    if not kept:  # the usual plan: no walk of stage 2's parameters
        return traced
    held = _frozen_bytes(traced.stage2, traced.trainable, under=kept)
    if not held:
        return traced
    reason = (
        f"the whole-step trace kept {', '.join(sorted(kept))} whole (tracing into it failed or "
        f"found no valid cut; see its note), so its stage 2 would run {held:,} bytes of frozen "
        "weights in it"
    )
    try:
        calls = split_calls(model, args, kwargs, frozen=frozen, reason=reason, recompute=recompute)
        # Stage 1 takes the batch as the split binds it (a dict batch's fields spread), as
        # verify() calls it.
        step = as_step_module(model, args, dict(kwargs or {}))
        with generators.forked(0), torch.no_grad():  # the user's random streams stay put
            calls.stage2(**calls.stage1(*step.args, **step.kwargs))
    except Exception:  # the module-level path cannot do better here: keep the trace's
        return traced
    if _frozen_bytes(calls.stage2, traced.trainable) >= held:
        return traced
    return calls


def _frozen_bytes(
    stage: nn.Module, trainable: frozenset[str], under: frozenset[str] | None = None
) -> int:
    """Bytes of the frozen parameters ``stage`` holds (those under a path of ``under`` only,
    when given); names as in the step module."""
    total = 0
    for name, param in stage.named_parameters():
        if name in trainable or param.requires_grad:
            continue
        if under is not None and not any(name.startswith(path + ".") for path in under):
            continue
        total += param.numel() * param.element_size()
    return total


def _whole_message(error: BaseException) -> str:
    """``str(error)`` and its notes (``add_note``), as a traceback shows them: the reason the
    module-level path's report quotes for the trace's refusal."""
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


def _split_traced(
    model: nn.Module | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    frozen: FrozenSpec,
    recompute: Recompute,
    max_plans: int,
) -> Split:
    """The whole-step trace's split (``path="trace"``)."""
    # 0. A function or bound method becomes a module whose forward calls it (same objects).
    step = as_step_module(model, args, dict(kwargs or {}))
    model = step.module
    named = list(model.named_parameters())
    frozen_names = resolve_frozen(model, frozen, named=named)
    trainable = frozenset(name for name, _ in named if name not in frozen_names)
    planner = _Planner(model, trainable, recompute)
    first = planner.plan(step.args, step.kwargs)
    plans = PlanSet(first, planner.plan_another, max_plans=max_plans)
    plans.install()
    return Split(
        stage1=first.stage1,
        stage2=first.stage2,
        boundary=first.boundary,
        input_names=first.input_names,
        trainable=trainable,
        graph=first.graph,
        cut=first.cut,
        batch_sizes=first.batch_sizes,
        model_name=type(model).__name__,
        notes=first.notes,
        _model=model,
        plan_set=plans,
    )


@dataclass(frozen=True)
class _Planner:
    """Makes a plan from an example batch: the steps below, for the step module ``model``.

    Every plan it makes (the first, and one per later shape signature) reads and fills the
    same memos of meta runs (:mod:`graphsplit.planning.meta.shared_memos`).
    """

    model: nn.Module
    trainable: frozenset[str]
    recompute: Recompute
    memos: SharedMemos = field(default_factory=SharedMemos, repr=False, compare=False)

    def plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        """:meth:`_plan`; refused where int sites answered (planning/tracing/int_calls.py: the
        analysis may refuse what a traced ``int()`` made), made again with Python's int there."""
        with INT_SITES.collecting() as used:
            try:
                return self._plan(args, kwargs)
            except Exception:
                if not used:
                    raise
        with INT_SITES.declining(used):
            return self._plan(args, kwargs)

    def _plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        started = time.perf_counter()
        model = self.model
        # 1. Bind the example batch to forward's parameters; meta twins at two batch sizes.
        examples = bind_examples(model, args, kwargs)
        # 2. Trace and analyse (in rounds), then give the graph back the step's real device.
        with sharing(self.memos):
            traced = trace_and_analyze(model, examples, self.trainable)
        refuse_weight_constants(traced.graph, traced.constants)  # computed from meta weights
        restore_devices(traced.graph, examples.device)
        # 3. Choose the boundary: the one place where that decision is taken.
        cut = choose_boundary(traced.graph, self.trainable, recompute=self.recompute, model=model)
        guard_constant_sizes(traced.graph, cut)  # a constant's shape is fixed per plan
        boundary = boundary_specs(cut)
        keys = list(boundary)
        # 4. Generate the two stages from the cut; under an ambient autocast, the boundary's
        #    dtypes are the ones stage 1 really makes (the analysis on meta cannot see it).
        stage1 = build_stage1(traced.graph, cut, keys, model, traced.constants)
        stage2 = build_stage2(traced.graph, cut, keys, model, traced.constants)
        boundary = with_run_dtypes(boundary, stage1, model, tuple(args), dict(kwargs))
        refuse_read_dtypes(cut, boundary)  # a dtype the trace held that the run does not make
        return Plan(
            stage1=stage1,
            stage2=stage2,
            boundary=boundary,
            input_names=traced.input_names,
            graph=traced.graph,
            cut=cut,
            batch_sizes=traced.batch_sizes or examples.batch_sizes,
            notes=[*traced.notes, *compiled_code_notes(stage2, model)],
            signature=signature_of(stage1, stage2),
            example=example_record(tuple(args), dict(kwargs)),
            seconds=time.perf_counter() - started,
            defaulted=defaults_taken(model, examples.inputs),
            kept_whole=traced.kept_whole,
        )

    @one_planning_at_a_time  # a plan made for a later batch waits like a split() does
    def plan_another(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        """The plan for a batch no plan fits: the planner again, that batch the example."""
        return self.plan(args, kwargs)
