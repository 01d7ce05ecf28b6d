"""Which tensors the step's torch calls take, by the outermost frozen call running them.

Stage 2 should hold only what it runs, and the cache only what stage 2 reads. During the two
seeded probes a :class:`Usage` (a ``TorchFunctionMode``) records the ids of the tensors every
torch call takes, under the frozen call that is running (its *context*; None outside any).
After the verdicts, what stage 2 runs is the step outside the cached calls plus the calls left
in it, so:

    needed_tensors(usages, cached) -> ids    # the tensors stage 2's ops compute with
    field_uses(probes, usages, cached) -> {call: {field: FREE | SHAPE | VALUE}}
    inner_calls(probes, usages, uses) -> {call: reader}   # outputs only cached calls read

A frozen module none of whose parameters or buffers are needed (diffusers' VAE decoder when the
step only encodes) is not held by stage 2. Each field (tensor) of a cached call's output is
stored only when stage 2 computes with it (VALUE: a torch call outside the cached calls takes
it for more than its metadata, or the step returns it); a field stage 2 reads only the shape of
(SHAPE) has its shape stored; any other field (FREE) is not stored, and stage 2 holds an
:class:`~graphsplit.calls.field_reads.Unstored` stand-in
(:func:`~graphsplit.calls.field_reads.read_kind` is the one table of what counts as which
read). Passing a field through Python (``out.hidden_states[-2]``, ``dict(out)``) is no torch
call: what counts is what torch then does with the tensor. A call none of whose fields stage 2
reads (the VAE's encoder, whose output only its cached ``quant_conv`` reads) is not stored at
all. Reading a parameter's metadata alone (``vae.dtype``: :data:`METADATA`) does not count as
needing its weights.

Ids are stable only while a tensor lives: parameters, buffers and the probed outputs stay alive
through the probe, but a temporary freed before a call returned may have had an output's id.
So reads are stamped with a counter (``tick``), and only reads after the call returned count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from graphsplit.calls.field_reads import FREE, SHAPE, VALUE, read_kind
from graphsplit.calls.module_calls import CallId

Context = CallId | None

METADATA = frozenset(
    {
        "__get__",  # a property: .dtype, .shape, .device
        "__len__",
        "dim",
        "ndimension",
        "size",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "data_ptr",
        "get_device",
        "is_floating_point",  # diffusers' ModelMixin.dtype asks each parameter
        "is_complex",
        "is_contiguous",
        "is_signed",
    }
)
"""Tensor methods that read metadata, not values: they need no weights."""

MOVES = frozenset(
    {"to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16", "contiguous"}
)
"""Tensor methods that move or convert: given a tensor already where and what they ask for,
they return that very tensor (``vae.to(accelerator.device)`` on a VAE already there, as
diffusers' scripts with ``--offload`` move their encoders every step), computing nothing;
``nn.Module._apply`` then sets ``param.data`` to the same tensor. Such a call, and that set,
need no weights."""


class Usage(TorchFunctionMode):
    """Records, per context, the ids of the tensors torch calls take (``read``), of those they
    compute with (``computed``: not a metadata read such as ``.dtype`` or ``.shape``), and when
    each was last read for its shape or values (``shape_reads`` / ``value_reads``: id -> tick,
    by :func:`~graphsplit.calls.field_reads.read_kind`); ``returned``: the tick each call
    returned at.
    """

    def __init__(self) -> None:
        super().__init__()
        self._context: Context = None
        self.tick = 0
        self.read: dict[Context, set[int]] = {}
        self.computed: dict[Context, set[int]] = {}
        self.shape_reads: dict[Context, dict[int, int]] = {}
        self.value_reads: dict[Context, dict[int, int]] = {}
        self.returned: dict[CallId, int] = {}
        # Ids of tensors whose .device (or get_device()) a context read: code that places
        # data where a module's weights are (pipeline.device).
        self.device_reads: dict[Context, set[int]] = {}

    @property
    def context(self) -> Context:
        """The outermost frozen call running (None: the step's own code)."""
        return self._context

    @context.setter
    def context(self, call: Context) -> None:
        if self._context is not None and call is None:
            self.returned[self._context] = self.tick
        self._context = call

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ids = _tensor_ids(args)
        if kwargs:
            ids |= _tensor_ids(kwargs.values())
        result = func(*args, **(kwargs or {}))
        if ids:
            self.tick += 1
            self.read.setdefault(self.context, set()).update(ids)
            if not _metadata_only(func, args, result):
                self.computed.setdefault(self.context, set()).update(ids)
            elif _reads_device(func):
                self.device_reads.setdefault(self.context, set()).update(ids)
            kind = read_kind(func)
            if kind != FREE:
                table = self.value_reads if kind == VALUE else self.shape_reads
                stamps = table.setdefault(self.context, {})
                for key in ids:
                    stamps[key] = self.tick
        return result


def _reads_device(func: Any) -> bool:
    """``tensor.device`` (the descriptor's ``__get__``) or ``tensor.get_device()``."""
    name = getattr(func, "__name__", "")
    if name == "get_device":
        return True
    return (
        name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "device"
    )


def device_read_tensors(usages: list[Usage], cached: set[CallId]) -> set[int]:
    """Ids of the tensors whose device the step reads outside ``cached`` calls, in any probe."""
    return set().union(*(_in_stage2(usage.device_reads, cached) for usage in usages))


def _metadata_only(func: Any, args: Any, result: Any) -> bool:
    """Whether the call read metadata only: :data:`METADATA`, or a :data:`MOVES` call that
    returned the tensor it was given, or ``param.data = param`` (see :data:`MOVES`)."""
    name = getattr(func, "__name__", "")
    if name in METADATA or name == "_has_compatible_shallow_copy_type":
        return True
    if name in MOVES:
        return bool(args) and result is args[0]
    if name == "__set__":  # a data descriptor: ``tensor.data = value``
        return len(args) == 2 and args[0] is args[1]
    return False


def _tensor_ids(values: Iterable[Any]) -> set[int]:
    found = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            found.add(id(value))
        elif isinstance(value, list | tuple):
            found |= _tensor_ids(value)
        elif isinstance(value, Mapping):
            found |= _tensor_ids(value.values())
    return found


def _in_stage2(table: dict[Context, set[int]], cached: set[CallId]) -> set[int]:
    return set().union(*(ids for context, ids in table.items() if context not in cached))


def needed_tensors(usages: list[Usage], cached: set[CallId]) -> set[int]:
    """Ids of the tensors the step computes with outside ``cached`` calls, in any probe."""
    return set().union(*(_in_stage2(usage.computed, cached) for usage in usages))


_ORDER = (FREE, SHAPE, VALUE)


def _latest(table: dict[Context, dict[int, int]], cached: set[CallId]) -> dict[int, int]:
    """id -> the last tick a context stage 2 runs read it at."""
    latest: dict[int, int] = {}
    for context, stamps in table.items():
        if context not in cached:
            for key, tick in stamps.items():
                latest[key] = max(latest.get(key, 0), tick)
    return latest


def field_uses(
    probes: list[Any], usages: list[Usage], cached: set[CallId]
) -> dict[CallId, dict[str, str]]:
    """Per cached call, per output field, the most stage 2 reads of it in any probe: VALUE
    (a torch call outside the cached calls computes with it, or the step returns it), SHAPE
    (reads its shape only) or FREE (its dtype or rank at most, or nothing)."""
    uses: dict[CallId, dict[str, str]] = {call: {} for call in cached}
    for probe, usage in zip(probes, usages):
        returned = {id(leaf) for leaf in torch.utils._pytree.tree_leaves(probe.result)}
        values, shapes = _latest(usage.value_reads, cached), _latest(usage.shape_reads, cached)
        for call in cached:
            seen = probe.calls.get(call)
            if seen is None:  # not made in this run: nothing proves a field unread
                uses[call] = dict.fromkeys(uses[call], VALUE)
                continue
            after = usage.returned.get(call, 0)
            for field, tensor in seen.tensors.items():
                key = id(tensor)
                if key in returned or values.get(key, -1) > after:
                    use = VALUE
                else:
                    use = SHAPE if shapes.get(key, -1) > after else FREE
                known = uses[call].get(field, FREE)
                uses[call][field] = max(known, use, key=_ORDER.index)
    return uses


def inner_calls(
    probes: list[Any], usages: list[Usage], uses: dict[CallId, dict[str, str]]
) -> dict[CallId, CallId | None]:
    """The cached calls none of whose output fields stage 2 reads (every one FREE in
    :func:`field_uses`). The value is a cached call that reads the output (None: nothing)."""
    inner: dict[CallId, CallId | None] = {}
    for call, fields in uses.items():
        if not fields or any(use != FREE for use in fields.values()):
            continue
        reader: CallId | None = None
        for probe, usage in zip(probes, usages):
            outputs = {id(tensor) for tensor in probe.calls[call].tensors.values()}
            readers = [  # the call's own bookkeeping (its outputs' versions) is no reader
                c for c, ids in usage.read.items() if c in uses and c != call and outputs & ids
            ]
            reader = reader or (readers[0] if readers else None)
        inner[call] = reader
    return inner


def unused_modules(
    modules: Mapping[str, torch.nn.Module],
    needed: set[int],
    kept: Iterable[str],
    dropped: Iterable[str],
) -> frozenset[str]:
    """The outermost frozen modules (path -> module) none of whose parameters or buffers
    stage 2 computes with, but for those in ``kept`` (a call left in stage 2 runs them whole)
    and those at or inside a ``dropped`` path (answered from the cache, left out already)."""
    kept, dropped = set(kept), set(dropped)

    def inside(path: str, paths: set[str]) -> bool:
        return any(path == other or path.startswith(other + ".") for other in paths)

    unused = set()
    for path, module in modules.items():
        if inside(path, kept) or inside(path, dropped):
            continue
        tensors = [*module.parameters(), *module.buffers()]
        if not any(id(tensor) in needed for tensor in tensors):
            unused.add(path)
    return frozenset(p for p in unused if not any(p.startswith(o + ".") for o in unused))
