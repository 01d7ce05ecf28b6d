"""Which tensors the step's torch calls take, by the outermost frozen call running them.

Stage 2 should hold only what it runs, and the cache only what stage 2 reads. During the two
seeded probes a :class:`Usage` (a ``TorchFunctionMode``) records the ids of the tensors every
torch call takes, under the frozen call that is running (its *context*; None outside any).
After the verdicts, what stage 2 runs is the step outside the cached calls plus the calls left
in it, so:

    needed_tensors(usages, cached) -> ids    # the tensors stage 2's ops compute with
    inner_calls(probes, usages, cached) -> {call: reader}   # outputs only cached calls read

A frozen module none of whose parameters or buffers are needed (diffusers' VAE decoder when the
step only encodes) is not held by stage 2. A cached call whose output only other cached calls
read (the VAE's encoder, whose output goes to its ``quant_conv``) is not stored: stage 2
answers it with tensors on ``meta`` of the probe's shapes, which the cached reader ignores.
Reading an output's metadata (``.shape``) counts as a read; reading a parameter's metadata
alone (``vae.dtype``: :data:`METADATA`) does not count as needing its weights. Ids are stable here:
parameters, buffers and the probed outputs stay alive through the probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

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


class Usage(TorchFunctionMode):
    """Records, per context, the ids of the tensors torch calls take (``read``) and of those
    they compute with (``computed``: not a metadata read such as ``.dtype`` or ``.shape``)."""

    def __init__(self) -> None:
        super().__init__()
        self.context: Context = None
        self.read: dict[Context, set[int]] = {}
        self.computed: dict[Context, set[int]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ids = _tensor_ids(args)
        if kwargs:
            ids |= _tensor_ids(kwargs.values())
        if ids:
            self.read.setdefault(self.context, set()).update(ids)
            if getattr(func, "__name__", "") not in METADATA:
                self.computed.setdefault(self.context, set()).update(ids)
        return func(*args, **(kwargs or {}))


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


def inner_calls(
    probes: list[Any], usages: list[Usage], cached: set[CallId]
) -> dict[CallId, CallId | None]:
    """The cached calls whose output (every tensor of it) stage 2 never reads, in every probe:
    not read outside cached calls, not part of what the step returns. The value is a cached
    call that reads it (None: nothing does)."""
    inner: dict[CallId, CallId | None] = {}
    for call in cached:
        reader: CallId | None = None
        for probe, usage in zip(probes, usages):
            seen = probe.calls.get(call)
            if seen is None or not seen.tensors:
                break
            outputs = {id(tensor) for tensor in seen.tensors.values()}
            returned = {id(leaf) for leaf in torch.utils._pytree.tree_leaves(probe.result)}
            if outputs & (_in_stage2(usage.read, cached) | returned):
                break
            readers = [  # the call's own bookkeeping (its outputs' versions) is no reader
                c for c, ids in usage.read.items() if c not in (None, call) and outputs & ids
            ]
            reader = reader or (readers[0] if readers else None)
        else:
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
