"""Probe the step: run it twice under different seeds and judge each frozen module call.

:func:`probe` runs the step once with every frozen module's outermost calls routed
(:mod:`.module_calls`) and records, per call, its inputs (:mod:`.provenance`), whether it drew
random numbers (:mod:`.generators`), whether it mutated its inputs, its outputs (:mod:`.outputs`)
and, at the end of the run, whether the step mutated those outputs in place.
:func:`judge` compares two probes and gives each call of the first its :class:`Verdict`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsplit.calls import generators, row_folds
from graphsplit.calls.field_reads import Reads, field_names, unwatch, watch
from graphsplit.calls.model_outputs import is_model_output
from graphsplit.calls.module_calls import CallId, CallRouter
from graphsplit.calls.outputs import NotATensor, Structure, flatten
from graphsplit.calls.provenance import CallInputs, carries_grad
from graphsplit.calls.reordered import Reordered
from graphsplit.calls.row_folds import rows_not_following
from graphsplit.calls.usage import Usage
from graphsplit.calls.verdicts import CallVerdict, Verdict


@dataclass
class ProbedCall:
    """What one run saw of one call."""

    call: CallId
    inputs: CallInputs
    trainable_input: bool  # autograd's record, read off the live inputs (the copies have none)
    draws: bool
    mutates_inputs: bool
    structure: Structure | None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    not_a_tensor: NotATensor | None = None
    versions: list[int] = field(default_factory=list)
    mutated_later: list[str] = field(default_factory=list)
    aliased: set[str] = field(default_factory=set)
    """Output fields sharing memory with an input, the module's state or another field."""
    parts: dict[str, tuple[Structure | None, NotATensor | None]] | None = None
    """A ``ModelOutput``'s fields, each flattened alone (None for any other output)."""
    reads: Reads = field(default_factory=Reads)
    watched: bool = False  # its reads were recorded (only an output not cacheable whole)
    output_type: type | None = None


@dataclass
class Probe:
    """One run of the step: its calls in order, and what it returned."""

    calls: dict[CallId, ProbedCall]
    result: Any
    nested: set[tuple[str, str]] = field(default_factory=set)
    """``(outer, inner)``: ``inner`` was called inside an outermost call of ``outer``."""
    written: list[torch.Tensor] = field(default_factory=list)
    """The step's input tensors it wrote in place (put back after the run)."""


def probe(
    step: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modules: dict[str, nn.Module],
    seed: int,
    batch_size: int = 1,
    usage: Usage | None = None,
) -> Probe:
    """Run ``step`` from ``seed`` (every generator) with the frozen modules' calls recorded
    (and, with ``usage``, the tensors its torch calls take, :mod:`.usage`)."""
    calls: dict[CallId, ProbedCall] = {}

    def record(call: CallId, module: nn.Module, forward: Any, a: tuple, kw: dict) -> Any:
        if usage is None:
            return _record(call, module, forward, a, kw)
        usage.context = call  # the bookkeeping's reads of the inputs are the call's own
        try:
            return _record(call, module, forward, a, kw)
        finally:
            usage.context = None

    def _record(call: CallId, module: nn.Module, forward: Any, a: tuple, kw: dict) -> Any:
        inputs = CallInputs.of(a, kw)
        live = [leaf for leaf in _leaves(a, kw) if isinstance(leaf, torch.Tensor)]
        live += list(module.buffers())  # a call that writes its own buffers (running stats)
        before = [version(t) for t in live]
        state = generators.snapshot()
        output = forward(*a, **kw)
        draws = generators.snapshot() != state
        mutates = [version(t) for t in live] != before
        seen = ProbedCall(call, inputs, carries_grad(live), draws, mutates, None)
        try:
            seen.structure, seen.tensors = flatten(output)
        except NotATensor as error:
            seen.not_a_tensor = error
        if isinstance(output, Mapping) and is_model_output(type(output)):
            seen.parts = {}
            seen.output_type = type(output)
            for key in list(output):
                try:
                    part, tensors = flatten(output[key], key)
                    seen.parts[key] = (part, None)
                    if seen.not_a_tensor is not None:
                        seen.tensors.update(tensors)
                except NotATensor as error:
                    seen.parts[key] = (None, error)
            if not _whole_cacheable(seen, batch_size):  # else its class stays the user's
                seen.watched = True
                watched.append((output, watch(output, seen.reads)))
        seen.versions = [version(t) for t in seen.tensors.values()]
        seen.aliased = aliased(seen.tensors, live + list(module.parameters()))
        calls[call] = seen
        return output

    watched: list[tuple[Any, type]] = []
    router = CallRouter(modules, record)
    kept = _inputs_kept(args, kwargs)
    try:
        with (
            generators.seeded(seed),
            torch.enable_grad(),
            # A torch.compile'd module runs its own code (dynamo would compile the probe's
            # bookkeeping and recompile per call); routed as the stages route it (the
            # wrapper's path), which run it compiled.
            torch.compiler.set_stance("force_eager"),
            router.installed(),
            contextlib.nullcontext() if usage is None else usage,
        ):
            result = step(*args, **kwargs)
    finally:
        for output, original in watched:
            unwatch(output, original)
        written = _put_back_inputs(kept)
    for seen in calls.values():
        seen.mutated_later = [
            name
            for (name, tensor), before in zip(seen.tensors.items(), seen.versions)
            if version(tensor) != before
        ]
    return Probe(calls, result, router.nested, written)


def _inputs_kept(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int | None, torch.Tensor]]:
    """Each input tensor, its version and a copy: a step that writes its batch in place
    (Whisper's SpecAugment masks ``input_features`` with spans NumPy draws) must start every
    probe from the example as the user gave it. Left written, the second probe masked an
    already masked example, both probes fed the frozen encoder the same union of the masks, and
    its call was cached with one draw frozen in for every epoch."""
    leaves = [leaf for leaf in _leaves(args, kwargs) if isinstance(leaf, torch.Tensor)]
    return [
        (tensor, tensor._version, tensor.detach().clone())
        for tensor in dict.fromkeys(leaves)  # each tensor once
        if not tensor.is_inference()
    ]


def _put_back_inputs(
    kept: list[tuple[torch.Tensor, int | None, torch.Tensor]],
) -> list[torch.Tensor]:
    """The written inputs' values as :func:`_inputs_kept` found them (their identity kept: the
    probes follow the inputs by identity); returns the inputs that were written."""
    written = [tensor for tensor, before, _ in kept if tensor._version != before]
    for tensor, before, copy in kept:
        if tensor._version != before:
            with torch.no_grad():
                tensor.copy_(copy)
    return written


def version(tensor: torch.Tensor) -> int | None:
    """``tensor._version``; ``None`` for an inference tensor (made under
    ``torch.inference_mode()``, as DINOv2's linear evaluation runs its backbone), which keeps
    no version counter and cannot be written outside inference mode."""
    return None if tensor.is_inference() else tensor._version


def aliased(outputs: dict[str, torch.Tensor], state: list[torch.Tensor]) -> set[str]:
    """The output fields whose memory is also an input's, the module's, or another field's.

    A step that writes such a field in place writes that other tensor too, which a copy
    handed out by stage 2 would not: those calls stay refused (see :func:`_judge`).
    """

    def storage(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr() if tensor.numel() else -id(tensor)

    owners: dict[int, int] = {}
    for tensor in list(outputs.values()) + state:
        owners[storage(tensor)] = owners.get(storage(tensor), 0) + 1
    return {name for name, tensor in outputs.items() if owners[storage(tensor)] > 1}


def _leaves(args: tuple, kwargs: dict) -> list[Any]:
    import torch.utils._pytree as pytree

    return pytree.tree_leaves((args, kwargs))


def judge(
    first: Probe,
    second: Probe,
    batch_size: int,
    alone: Probe | None = None,
    reordered: Reordered | None = None,
    moved: Probe | None = None,
) -> list[CallVerdict]:
    """Each call of ``first``, judged against the same call of ``second`` (another seed, the
    trainable parameters moved: :func:`.provenance.moved`) and of ``alone`` (the batch's last
    sample run by itself; None at batch size 1), or, where the step cannot run one sample
    alone, of ``reordered`` (runs at the batch's own size with its samples reordered and
    repeated, :mod:`.reordered`). ``moved`` (``first``'s seed, the parameters moved; None when
    no call's inputs differ in ``second``) tells which differences the move made.

    A call with a batched input caches per sample: its last row must be what the last sample
    gives alone (else it mixes samples). A call without one would be stored once, as a
    constant: its inputs must be the same when another sample runs (else they depend on the
    sample, without a batch dimension: a per-sample loop's call), and at batch size 1, where
    no other sample can run, such a call is not cached.
    """
    verdicts = []
    for call, seen in first.calls.items():
        others = reordered.probes if reordered is not None else []
        _narrow(call, [first, second, alone, *others], batch_size)
        verdict = _judge(seen, second.calls.get(call), batch_size)
        if verdict.verdict is Verdict.RANDOM_INPUT and moved_by_training(seen, moved):
            verdict = CallVerdict(call[0], call[1], Verdict.TRAINABLE_VALUE)
        folds = row_folds.candidates(seen.inputs.tensors(), seen.tensors, batch_size)
        fold, why = None, ""
        if verdict.cached and folds:
            other = None if alone is None else alone.calls.get(call)
            fold, why = row_folds.shown(folds, seen, batch_size, other, reordered)
        if fold is not None:
            detail = "; ".join(part for part in (verdict.detail, fold.describe()) if part)
            verdict = dataclasses.replace(verdict, fold=fold, detail=detail)
        elif verdict.cached and reordered is not None:
            batched = is_batched(seen.inputs.tensors(), batch_size)
            if batched or seen.inputs.tensors():
                verdict = reordered.verdict(call, seen, batched) or verdict
        elif verdict.cached:
            other = None if alone is None else alone.calls.get(call)
            if is_batched(seen.inputs.tensors(), batch_size):
                mixed = None if alone is None else _mixed_fields(seen, other)
                if mixed is not None:
                    verdict = CallVerdict(call[0], call[1], Verdict.MIXES_SAMPLES, mixed)
            elif seen.inputs.tensors() and (
                other is None or seen.inputs.difference(other.inputs) is not None
            ):
                detail = (
                    "an unbatched input may depend on the sample: split with two or more samples"
                    if alone is None
                    else "an unbatched input changes with the sample (a per-sample call)"
                )
                verdict = CallVerdict(call[0], call[1], Verdict.NOT_PER_SAMPLE, detail)
        if why and not verdict.cached:  # why its k * B rows were not cached k a sample
            verdict = dataclasses.replace(verdict, detail=f"{verdict.detail}; {why}")
        verdicts.append(verdict)
    return verdicts


def any_input_differs(first: Probe, second: Probe) -> bool:
    """Whether a call of ``first`` without autograd history has other inputs in ``second``
    (or is not made there): a call :func:`judge` would find depends on a draw or, with
    ``moved``, on the trainable parameters."""
    for call, seen in first.calls.items():
        other = second.calls.get(call)
        if not seen.trainable_input and (
            other is None or seen.inputs.difference(other.inputs) is not None
        ):
            return True
    return False


def moved_by_training(seen: ProbedCall, moved: Probe | None) -> bool:
    """Whether the call's inputs changed (or it was not made) when only the trainable
    parameters moved: the same seed as ``seen``'s run, so no draw differs."""
    if moved is None:
        return False
    other = moved.calls.get(seen.call)
    return other is None or seen.inputs.difference(other.inputs) is not None


def _mixed_fields(seen: ProbedCall, alone: ProbedCall | None) -> str | None:
    """Which output fields' last row differs from the last sample run alone (None: none)."""
    if alone is None:
        return "the call is not made when the last sample runs alone"
    return rows_not_following(seen.tensors, alone.tensors, (-1,), exact=False) or None


def _whole_cacheable(seen: ProbedCall, batch_size: int) -> bool:
    if seen.not_a_tensor is not None:
        return False
    if not is_batched(seen.inputs.tensors(), batch_size):
        return True
    return all(batch_dim(t, batch_size) is not None for t in seen.tensors.values())


def _narrow(call: CallId, probes: list[Probe | None], batch_size: int) -> None:
    """A ``ModelOutput`` the cache cannot hold whole, read by the step only field by field
    (in every probe): each probe's view of the call narrowed to the fields read, the others
    left out (stage 2's stand-in raises on them). Not read by name alone: left as it is, and
    the verdict says what read it whole."""
    seen = probes[0].calls[call]  # type: ignore[union-attr]
    if seen.parts is None or _whole_cacheable(seen, batch_size):
        return
    views = [p.calls[call] for p in probes if p is not None and call in p.calls]
    if any(view.parts is not None and not view.watched for view in views):
        return  # a run whose reads were not recorded: nothing proves the field reads
    reads = Reads()
    for view in views:
        reads.merge(view.reads)
    if reads.whole is not None:
        seen.reads.whole = reads.whole
        return
    names = field_names(type_of(seen))
    needed = [name for name in sorted(names, key=_order(type_of(seen))) if name in reads.fields]
    for view in views:
        if view.parts is None:
            continue
        left_out = tuple(key for key in view.parts if key not in reads.fields)
        bad = [view.parts[key][1] for key in needed if key in view.parts and view.parts[key][1]]
        if bad:
            view.not_a_tensor = bad[0]
            continue
        children = tuple(
            view.parts[key][0] if key in view.parts else Structure("none")  # type: ignore[misc]
            for key in needed
        )
        view.structure = Structure("mapping", view.output_type, tuple(needed), children, left_out)
        kept = {
            name: tensor
            for name, tensor in view.tensors.items()
            if any(name == key or name.startswith(key + "__") for key in needed)
        }
        view.mutated_later = [name for name in view.mutated_later if name in kept]
        view.tensors = kept
        view.not_a_tensor = None


def type_of(seen: ProbedCall) -> type:
    return seen.output_type  # type: ignore[return-value]


def _order(container: type) -> Any:
    order = {f.name: i for i, f in enumerate(dataclasses.fields(container))}
    return lambda name: order[name]


def _judge(seen: ProbedCall, other: ProbedCall | None, batch_size: int) -> CallVerdict:
    path, index = seen.call

    def verdict(kind: Verdict, detail: str = "") -> CallVerdict:
        return CallVerdict(path, index, kind, detail)

    whole = (
        f"; the step reads the output as a whole ({seen.reads.whole}), so no field of it can "
        "be left out"
        if seen.reads.whole
        else ""
    )
    if seen.not_a_tensor is not None:
        error = seen.not_a_tensor
        return verdict(Verdict.NON_TENSOR, f"{error.where} is a {error.type_name}{whole}")
    if seen.trainable_input:
        return verdict(Verdict.TRAINABLE_INPUT)
    if other is None:
        return verdict(Verdict.RANDOM_INPUT, "the other run made no such call")
    difference = seen.inputs.difference(other.inputs)
    if difference is not None:
        return verdict(Verdict.RANDOM_INPUT, difference)
    if seen.structure != other.structure:  # a number the plan would keep as a constant
        return verdict(Verdict.NON_TENSOR, "a number in it differs between two runs" + whole)
    if seen.draws or other.draws:
        return verdict(Verdict.DRAWS_ITSELF)
    if seen.mutates_inputs:
        return verdict(Verdict.MUTATED, "the call mutates its inputs or its module's buffers")
    # The step writing a fresh output in place is eager's own work, redone on a copy in stage 2.
    mutated = sorted(set(seen.mutated_later) | set(other.mutated_later))
    shared = [name for name in mutated if name in seen.aliased or name in other.aliased]
    if shared:
        return verdict(
            Verdict.MUTATED,
            "the step mutates " + ", ".join(shared) + " in place, and it shares memory with the "
            "call's inputs, its module's weights or another of its outputs",
        )
    if is_batched(seen.inputs.tensors(), batch_size):
        unbatched = [name for name, t in seen.tensors.items() if batch_dim(t, batch_size) is None]
        if unbatched:
            return verdict(Verdict.NOT_PER_SAMPLE, ", ".join(unbatched) + whole)
    if mutated:
        detail = "the step then writes " + ", ".join(mutated) + " in place: stage 2 hands it a copy"
        return CallVerdict(path, index, Verdict.CACHED, detail, copied=tuple(mutated))
    return verdict(Verdict.CACHED)


def is_batched(tensors: list[torch.Tensor], batch_size: int) -> bool:
    """Whether any of a call's input tensors has the batch's size first."""
    return any(batch_dim(t, batch_size) == 0 for t in tensors)


def batch_dim(tensor: torch.Tensor, batch_size: int) -> int | None:
    return 0 if tensor.dim() >= 1 and tensor.shape[0] == batch_size else None
