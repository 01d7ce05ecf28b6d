"""``split_calls``: make a module-level split (see :mod:`graphsplit.calls`).

as_step_module -> frozen modules -> probe twice (seeds 0, 1; the trainable weights moved in
    the second, and a third run, seed 0 moved, when a call's inputs differ) -> verdicts -> CallPlan
    -> CallStage1 / CallStage2 -> CallSplit
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from graphsplit.artifacts import BoundarySpec
from graphsplit.calls import forced_draws, generators
from graphsplit.calls.analysis import Probe, any_input_differs, batch_dim, judge, probe
from graphsplit.calls.call_plan import CallPlan, InputSpec, Placeholder, input_spec
from graphsplit.calls.call_report import CallSplit
from graphsplit.calls.field_reads import VALUE
from graphsplit.calls.module_calls import CallId, frozen_modules, needed_routes
from graphsplit.calls.provenance import MOVED, moved
from graphsplit.calls.recomputed import Redone, redone_calls
from graphsplit.calls.reordered import probe_reordered, take
from graphsplit.calls.stages import CallStage1, CallStage2
from graphsplit.calls.stopped_step.written_tensors import tensors_put_back
from graphsplit.calls.stored import spec_of, storage, stored_verdict
from graphsplit.calls.unfrozen import no_frozen_call, under_no_grad_only
from graphsplit.calls.unstored_inputs.derivation import Derivation, lone_inputs, unstored_inputs
from graphsplit.calls.usage import (
    device_read_tensors,
    field_uses,
    inner_calls,
    needed_tensors,
    unused_modules,
)
from graphsplit.calls.verdicts import CallVerdict, Verdict, every_call_cached, unhooked
from graphsplit.errors import Fix, GraphsplitError, SplitError, user_error
from graphsplit.planning.rules.random_draws import own_generators
from graphsplit.planning.step.callables import as_step_module
from graphsplit.planning.step.frozen import FrozenSpec, resolve_frozen
from graphsplit.planning.step.raw_samples import is_raw_sample

SEEDS = (0, 1)
"""The two seeds the step runs under to find inputs that depend on a draw."""


@tensors_put_back  # the runs below write into the model as the step does: put back after
def split_calls(
    model: nn.Module | Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    frozen: FrozenSpec = None,
    reason: str = "",
    recompute: str = "never",
    opened: frozenset[str] = frozenset(),
) -> CallSplit:
    """Split a step at its frozen module calls whose inputs are a function of the sample alone.

    ``reason``: why the whole-step trace is not used (shown by ``report()``). Raises
    :class:`~graphsplit.SplitError` when no frozen call can be cached, listing each call's
    verdict.

    ``opened``: frozen modules whose calls are not routed, so that the frozen modules they call
    are judged on their own. The split fills it itself: a frozen module every call of which
    takes a trainable or random input, and inside which other frozen modules were called (DeiT's
    ``DistillationLoss``, holding the teacher it calls on the images, called on the student's
    outputs), is opened and the step analysed again, when no other call is cached; that split
    is taken where a call inside an opened module is cached.
    """
    step = as_step_module(model, args, dict(kwargs or {}))
    module = step.module
    named = list(module.named_parameters())
    frozen_names = resolve_frozen(module, frozen, named=named)
    trainable = frozenset(name for name, _ in named if name not in frozen_names)
    routed = {p: m for p, m in frozen_modules(module, trainable).items() if p not in opened}
    # Its random.Random / NumPy generators: the probes seed them and every run gives them back.
    generators.remember(own_generators(module).values())
    signature = inspect.signature(module.forward)
    try:
        values = dict(signature.bind(*step.args, **step.kwargs).arguments)
    except TypeError as error:
        raise user_error(
            SplitError,
            f"the example batch does not match the step: {error}.",
            fix=Fix("pass args/kwargs exactly as you would call the step"),
        ) from None
    raw = is_raw_sample(values)  # one dataset item as it is: a batch of one sample
    batch_size = 1 if raw else _batch_size(values)
    inputs = tuple(input_spec(name, value, batch_size, raw=raw) for name, value in values.items())
    roots = {
        spec.name: values[spec.name]
        for spec in inputs
        if spec.kind == "tensor" and batch_dim(values[spec.name], batch_size) == 0
    }
    moving = [param for name, param in named if name in trainable]
    in_moved_run = False
    try:
        with _grad_flags(named, trainable):
            usages = [Derivation(roots), Derivation(roots)]
            with forced_draws.watched() as drawn:
                first = probe(
                    module, step.args, step.kwargs, routed, SEEDS[0], batch_size, usages[0]
                )
            # The second run also moves the trainable weights (.provenance.moved): a frozen call
            # fed them under no_grad has no autograd record, but its inputs then differ.
            in_moved_run = True
            with moved(moving):
                second = probe(
                    module, step.args, step.kwargs, routed, SEEDS[1], batch_size, usages[1]
                )
                # Which differences the move made, not a draw: the first seed again.
                changed = (
                    probe(module, step.args, step.kwargs, routed, SEEDS[0], batch_size)
                    if any_input_differs(first, second)
                    else None
                )
            in_moved_run = False
            alone, reordered = None, None
            if batch_size > 1:
                one = _last_sample(signature, values, batch_size)
                try:
                    alone = probe(module, *one, routed, SEEDS[0], 1)
                except Exception as error:  # the step runs at its own batch size only
                    reordered = probe_reordered(
                        lambda a, kw: probe(module, a, kw, routed, SEEDS[0], batch_size),
                        values,
                        batch_size,
                        error,
                        lambda cut: _arguments(signature, cut),
                    )
    except GraphsplitError:
        raise
    except Exception as error:  # the user's step itself failed on the example batch
        raise _step_failed(error, in_moved_run) from error
    verdicts = judge(first, second, batch_size, alone, reordered, changed)
    ends = forced_draws.ENDS if drawn[0] else ()
    forced_runs = [_forced_probe(module, step, routed, end, batch_size) for end in ends]
    steered = forced_draws.steered_calls(first, forced_runs)
    verdicts = [
        CallVerdict(v.path, v.index, Verdict.RARE_BRANCH, steered[(v.path, v.index)])
        if v.cached and (v.path, v.index) in steered
        else v
        for v in verdicts
    ]
    verdicts = unhooked(verdicts, routed)  # hooks inside a cached call would not run
    # Only where nothing else is cached: opening renumbers the calls inside, and a plan that
    # caches other calls already is kept as it is (its fingerprint, its boundary).
    more = _to_open(verdicts, first.nested | second.nested) - opened
    if more and not any(v.cached for v in verdicts):
        try:
            wider = split_calls(
                model,
                args,
                kwargs,
                frozen=frozen,
                reason=reason,
                recompute=recompute,
                opened=opened | more,
            )
        except SplitError:  # nothing cacheable with them opened either
            wider = None
        # Taken only where a call inside them is cached; else the calls stay counted as before.
        if wider is not None and any(
            v.cached and _inside(v.path, more) for v in wider.plan.verdicts
        ):
            return wider
    candidates = {(v.path, v.index) for v in verdicts if v.cached}
    if not candidates:
        listed = "\n".join(v.line() for v in verdicts) or "  (the step calls no frozen module)"
        unfrozen = under_no_grad_only(
            module,
            trainable,
            lambda: probe(module, step.args, step.kwargs, routed, SEEDS[0], batch_size),
        )
        raise no_frozen_call(listed, unfrozen, called=bool(verdicts))
    # A frozen layer computing from what stage 2 reads anyway may be cheaper to redo there.
    redone = redone_calls(
        candidates,
        [first, second],
        usages,
        routed,
        roots,
        batch_size,
        lambda cached: _stored_bytes(cached, [first, second], usages, verdicts, roots, batch_size),
    )
    if recompute == "auto" and redone.calls:
        candidates -= redone.calls
        verdicts = [_redone_verdict(v, redone) for v in verdicts]
    # Stage 2 holds what it computes with, the cache what stage 2 reads (see .usage).
    uses = field_uses([first, second], usages, candidates)
    inner = inner_calls([first, second], usages, uses)
    lone = lone_inputs(inputs, uses, inner)
    results = [first.result, second.result]
    unstored, stored_inputs = unstored_inputs(usages, results, candidates, lone)
    inputs = tuple(
        dataclasses.replace(spec, kind="unstored", value=values[spec.name].dtype)
        if spec.name in unstored
        else spec
        for spec in inputs
    )
    boundary = _input_boundary(inputs, values, batch_size)
    crossing = {spec.name: values[spec.name] for spec in inputs if spec.kind == "tensor"}
    stored, not_stored = storage(verdicts, inner, uses, first, batch_size, boundary, crossing)
    placeholders = {call: _placeholder(call, first.calls[call]) for call in inner}
    verdicts = [stored_verdict(v, inner, stored) for v in verdicts]
    needed = needed_tensors(usages, candidates)
    dropped = frozenset(p for p in every_call_cached(verdicts) if not _computes(routed[p], needed))
    kept = {v.path for v in verdicts if not v.cached}
    unused = unused_modules(routed, needed, kept, dropped)
    read_device = device_read_tensors(usages, candidates)
    placed = frozenset(p for p in dropped | unused if _computes(routed[p], read_device))
    nested = first.nested | second.nested | (alone.nested if alone is not None else set())
    for run in reordered.probes if reordered is not None else []:
        nested |= run.nested
    routes = needed_routes(module, routed, {call[0] for call in candidates}, nested)
    # Stage 1 also routes the frozen modules stage 2 does not hold and the example never
    # called, to refuse a sample that calls one (stages.unseen_frozen_call).
    watched = frozenset(p for p in routed if _inside(p, unused) and not _inside(p, dropped))
    stage1_routes = needed_routes(module, routed, {c[0] for c in candidates} | watched, nested)
    written = _written_inputs(inputs, values, [first, second])
    plan = CallPlan(
        signature=signature,
        inputs=inputs,
        cached=stored,
        verdicts=tuple(verdicts),
        dropped=dropped,
        placed=placed,
        boundary=boundary,
        placeholders=placeholders,
        unused=unused,
        not_stored=not_stored,
        written_inputs=written,
    )
    return CallSplit(
        stage1=CallStage1(module, plan, stage1_routes, watched),
        stage2=CallStage2(module, plan, routes),
        boundary=boundary,
        input_names=tuple(values),
        trainable=trainable,
        plan=plan,
        batch_sizes=(batch_size, batch_size),
        model_name=type(module).__name__,
        reason=reason,
        notes=[
            "inputs were compared between two runs under seeds 0 and 1, the second with the "
            "trainable parameters moved: a random branch both runs took alike (a rare drop) "
            "is not seen (draw such choices after the frozen calls), nor a value that depends "
            "on the trainable parameters only through a choice the move left as it was (an "
            "argmax)",
            *_input_notes(inputs, stored_inputs),
            *_forced_notes(drawn[0], forced_runs),
            *_recompute_notes(redone, recompute),
            *(
                [
                    f"opened: {', '.join(sorted(opened))}: every call takes an input that "
                    "depends on a trainable parameter or a random draw, or holds hooks that "
                    "must run, so the frozen modules called inside were judged on their own"
                ]
                if opened
                else []
            ),
        ],
        _model=module,
    )


_INPUT_REFUSALS = frozenset(  # and hooks inside: the hooked module's own calls may be cached
    {Verdict.TRAINABLE_INPUT, Verdict.TRAINABLE_VALUE, Verdict.RANDOM_INPUT, Verdict.RARE_BRANCH}
    | {Verdict.HOOKED}
)


def _to_open(verdicts: list[CallVerdict], nested: set[tuple[str, str]]) -> frozenset[str]:
    """The frozen modules to open: every call refused for its inputs, and frozen modules
    called inside (``nested``: ``(outer, inner)`` pairs of the probes)."""
    refusals: dict[str, list[Verdict]] = {}
    for verdict in verdicts:
        refusals.setdefault(verdict.path, []).append(verdict.verdict)
    outers = {outer for outer, _ in nested}
    return frozenset(
        path
        for path, found in refusals.items()
        if path in outers and all(verdict in _INPUT_REFUSALS for verdict in found)
    )


def _inside(path: str, paths: frozenset[str]) -> bool:
    """Whether ``path`` is one of ``paths`` or a submodule of one."""
    return any(path == other or path.startswith(other + ".") for other in paths)


def _step_failed(error: Exception, in_moved_run: bool) -> GraphsplitError:
    """The refusal when the step raised during a probe (``in_moved_run``: the one with the
    trainable parameters moved, :func:`.provenance.moved`)."""
    if in_moved_run:
        return user_error(
            SplitError,
            f"the module-level path runs the step with its trainable parameters moved ({MOVED}"
            ") on the example batch, to find frozen calls fed from them under no_grad, and "
            f"the step raised {type(error).__name__}: {error}",
            fix=Fix(
                "let the step run with other trainable weights, as it must after an optimizer "
                "step (check the weights' values outside the step)"
            ),
        )
    return user_error(
        SplitError,
        "the module-level path runs the step on the example batch, and the step raised "
        f"{type(error).__name__}: {error}",
        fix=Fix(
            "pass an example batch the step runs on, with the frozen weights loaded (not "
            "on meta); the step must run outside torch.inference_mode()"
        ),
    )


def _stored_bytes(
    cached: set[CallId],
    probes: list[Any],
    usages: list[Any],
    verdicts: list[CallVerdict],
    roots: dict[str, torch.Tensor],
    batch_size: int,
) -> int:
    """The cache's bytes per sample were ``cached`` the cached calls: the fields stage 2 reads
    of the calls it reads, and the inputs it computes with (constants not counted)."""
    uses = field_uses(probes, usages, cached)
    inner = inner_calls(probes, usages, uses)
    unstored, _ = unstored_inputs(usages, [probe.result for probe in probes], cached)
    copied = {(v.path, v.index): v.copied for v in verdicts}
    folded = {(v.path, v.index) for v in verdicts if v.fold is not None}
    tensors = [
        (tensor, batch_dim(tensor, batch_size) == 0)
        for name, tensor in roots.items()
        if name not in unstored
    ]
    for call in cached - inner.keys():
        for name, tensor in probes[0].calls[call].tensors.items():
            if uses[call].get(name, VALUE) == VALUE or name in copied.get(call, ()):
                # A folded call's k * B rows are stored k a sample (.row_folds).
                per_sample = call in folded or batch_dim(tensor, batch_size) == 0
                tensors.append((tensor, per_sample))
    return sum(
        tensor.numel() * tensor.element_size() // batch_size
        for tensor, per_sample in tensors
        if per_sample
    )


def _redone_verdict(verdict: CallVerdict, redone: Redone) -> CallVerdict:
    trade = redone.trade_of((verdict.path, verdict.index))
    if trade is None:
        return verdict
    detail = (
        f"with the {len(trade.calls)} call(s) taking the same inputs: {trade.saved} bytes per "
        f"sample not stored, for a price of {trade.price} byte-equivalents"
    )
    return dataclasses.replace(verdict, verdict=Verdict.RECOMPUTED, detail=detail, copied=())


def _written_inputs(
    inputs: tuple[InputSpec, ...], values: dict[str, Any], probes: list[Probe]
) -> frozenset[str]:
    """The crossing boundary keys whose tensors share memory with an input the probes saw the
    step write in place (:attr:`CallPlan.written_inputs`)."""
    written = {tensor.untyped_storage().data_ptr() for run in probes for tensor in run.written}
    if not written:
        return frozenset()
    return frozenset(
        key
        for spec in inputs
        if spec.name in values and spec.kind != "unstored"
        for key, value in spec.crossing(values[spec.name]).items()
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in written
    )


def _forced_probe(
    module: nn.Module, step: Any, routed: dict[str, nn.Module], fraction: float, batch_size: int
) -> Probe | None:
    """The first probe again with the step's Python/NumPy draws forced (:mod:`.forced_draws`);
    None where the step fails so."""
    try:
        with forced_draws.forced(fraction):
            return probe(module, step.args, step.kwargs, routed, SEEDS[0], batch_size)
    except Exception:
        return None


def _forced_notes(drawn: int, runs: list[Probe | None]) -> list[str]:
    if not drawn:
        return []
    if all(run is not None for run in runs):
        return [
            f"the step draws from Python's or NumPy's generator ({drawn} draws): it was run "
            "again with those draws forced to the bottom and the top of their range, and a "
            "frozen call whose inputs a forced run changed is not cached"
        ]
    return [
        "the step draws from Python's or NumPy's generator, and failed when those draws were "
        "forced to an end of their range: a rare branch they steer was not checked"
    ]


def _recompute_notes(redone: Redone, recompute: str) -> list[str]:
    """The report's line on the frozen layers stage 2 could redo instead of storing them."""
    if recompute == "auto" or not redone.calls:
        return []
    saved = sum(trade.saved for trade in redone.trades)
    return [
        f"recompute='auto' would have stage 2 redo {len(redone.calls)} cached frozen layer "
        f"call(s) computing from what it reads anyway, storing {saved} fewer bytes per sample "
        "(stage 2 then holds their weights and runs their FLOPs, priced as the whole-step "
        "trace prices a frozen layer)"
    ]


def _input_notes(inputs: tuple[Any, ...], stored: dict[str, str]) -> list[str]:
    """The report's lines on the inputs a cached call took: left out of the cache, or why not."""
    notes = [
        f"input {spec.name!r} not stored: only cached calls compute with it (its shape is "
        "stored; stage 2 holds a stand-in on meta whose values nothing reads)"
        for spec in inputs
        if spec.kind == "unstored"
    ]
    notes += [f"input {name!r} stored: {why}" for name, why in sorted(stored.items())]
    return notes


def _last_sample(
    signature: inspect.Signature, values: dict[str, Any], batch_size: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example batch cut to its last sample: ``(args, kwargs)`` for the step. The last,
    not the first: a per-sample loop's call 0 then sees another sample than in the batch."""
    cut = {name: take(value, batch_size, slice(-1, None)) for name, value in values.items()}
    return _arguments(signature, cut)


def _arguments(
    signature: inspect.Signature, values: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    bound = inspect.BoundArguments(signature, values)  # type: ignore[arg-type]
    return bound.args, bound.kwargs


def _batch_size(values: dict[str, Any]) -> int:
    for leaf in torch.utils._pytree.tree_leaves(list(values.values())):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    for value in values.values():
        if isinstance(value, list | tuple):
            return len(value)
    return 1


def _input_boundary(
    inputs: tuple[Any, ...], values: dict[str, Any], batch_size: int
) -> dict[str, BoundarySpec]:
    boundary: dict[str, BoundarySpec] = {}
    for spec in inputs:
        if spec.kind == "constant":
            continue
        pads = spec.pad_dims()  # strings as code points: zeros past their ends pad them
        for key, tensor in spec.crossing(values[spec.name]).items():
            found = spec_of(key, tensor, batch_dim(tensor, batch_size), "input")
            pad = pads.get(key) if found.batch_dim == 0 else None
            boundary[key] = dataclasses.replace(found, pad_dim=pad)
    return boundary


def _placeholder(call: CallId, seen: Any) -> Placeholder:
    fields = {name: (tuple(t.shape), t.dtype) for name, t in seen.tensors.items()}
    return Placeholder(call, seen.structure, fields)


def _computes(module: nn.Module, needed: set[int]) -> bool:
    return any(id(tensor) in needed for tensor in (*module.parameters(), *module.buffers()))


@contextlib.contextmanager
def _grad_flags(named: list[tuple[str, nn.Parameter]], trainable: frozenset[str]) -> Iterator[None]:
    """During the probe, trainable parameters require grad and frozen ones do not, so that
    autograd's record says exactly which inputs depend on a trainable parameter."""
    saved = [(param, param.requires_grad) for _, param in named]
    try:
        for name, param in named:
            param.requires_grad_(name in trainable)
        yield
    finally:
        for param, flag in saved:
            param.requires_grad_(flag)
