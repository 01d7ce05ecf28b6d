"""What the module-level plan stores of each cached call: the boundary keys of the fields stage
2 computes with, the shapes of those it reads the shape of, the fields that echo the step's own
inputs (keyed by the input), and each verdict's note of what it leaves out.

    storage(verdicts, inner, uses, first, batch_size, boundary, crossing) -> (stored, not_stored)
    stored_verdict(verdict, inner, stored) -> the verdict with its storage note
    spec_of(name, tensor, dim, source) -> BoundarySpec
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphsplit.artifacts import BoundarySpec
from graphsplit.calls.analysis import batch_dim, is_batched
from graphsplit.calls.call_plan import CachedCall, Unread, cached_call, shape_rows
from graphsplit.calls.field_reads import SHAPE, VALUE
from graphsplit.calls.module_calls import CallId, key_of
from graphsplit.calls.row_folds import RowFold
from graphsplit.calls.verdicts import CallVerdict


def spec_of(name: str, tensor: torch.Tensor, dim: int | None, source: str) -> BoundarySpec:
    total = tensor.numel() * tensor.element_size()
    per_sample = total // max(int(tensor.shape[0]), 1) if dim == 0 else total
    return BoundarySpec(name, tuple(tensor.shape), tensor.dtype, dim, per_sample, source)


def storage(
    verdicts: list[CallVerdict],
    inner: dict[CallId, CallId | None],
    uses: dict[CallId, dict[str, str]],
    first: Any,
    batch_size: int,
    boundary: dict[str, BoundarySpec],
    crossing: dict[str, torch.Tensor],
) -> tuple[dict[CallId, CachedCall], dict[str, BoundarySpec]]:
    """The stored calls' plans, in the step's order, their keys added to ``boundary``; and
    every cached field not stored (of those and of the ``inner`` calls), as it would cross.

    A stored field that is one of the step's input tensors crossing as they are (``crossing``,
    by name), not written in place, takes that input's key: the call echoes its input."""
    stored: dict[CallId, CachedCall] = {}
    not_stored: dict[str, BoundarySpec] = {}
    for verdict in verdicts:
        call = (verdict.path, verdict.index)
        if not verdict.cached:
            continue
        seen = first.calls[call]
        fold = verdict.fold
        per_sample = fold is not None or is_batched(seen.inputs.tensors(), batch_size)
        label = f"{call[0]} call {call[1]}"
        planned = None
        if call not in inner:
            size = batch_size if per_sample else None
            planned = stored[call] = _sharing(
                _echoing(
                    cached_call_of(seen, uses[call], verdict.copied, size, fold), seen, crossing
                ),
                seen,
            )
        for field, tensor in seen.tensors.items():
            if planned is not None and (field in planned.echoed or field in planned.shared):
                continue  # the input's own key, or the other field's, is in the boundary
            dim = batch_dim(tensor, batch_size) if per_sample else None
            if fold is not None:
                tensor, dim = fold.fold(tensor), 0  # stored a sample's k rows an entry
            key = key_of(call, field)
            spec = spec_of(key, tensor, dim, f"{label}: {field}")
            if planned is not None and field in planned.keys:
                boundary[key] = spec
                continue
            not_stored[key] = spec
            shape_key = planned.unread[field].shape_key if planned is not None else None
            if shape_key is not None:
                shapes = shape_rows(tensor)
                boundary[shape_key] = spec_of(shape_key, shapes, 0, f"{label}: shape of {field}")
    return stored, not_stored


def cached_call_of(
    seen: Any,
    uses: dict[str, str],
    copied: tuple[str, ...],
    batch_size: int | None,
    fold: RowFold | None = None,
) -> CachedCall:
    """The plan of one stored call: the fields stage 2 computes with (and those the step
    writes in place) stored, the others :class:`Unread` (their shape stored where read; a
    folded call's field whose shape is read is stored whole: its shape rows would be the
    call's ``k * B``, not the batch's)."""
    call = seen.call
    fields, unread = [], {}
    for field, tensor in seen.tensors.items():
        use = uses.get(field, VALUE)
        if use == VALUE or field in copied or (fold is not None and use == SHAPE):
            fields.append(field)
            continue
        batched = fold is not None or (
            batch_size is not None and batch_dim(tensor, batch_size) == 0
        )
        shape_key = f"{key_of(call, field)}__shape" if use == SHAPE and batched else None
        unread[field] = Unread(tuple(tensor.shape), tensor.dtype, batched, shape_key)
    planned = cached_call(call, seen.structure, fields, copied, unread)
    return planned if fold is None else dataclasses.replace(planned, fold=fold)


def _echoing(planned: CachedCall, seen: Any, crossing: dict[str, torch.Tensor]) -> CachedCall:
    """``planned`` with its stored fields that are input tensors keyed by the input's name."""
    by_id = {id(tensor): name for name, tensor in crossing.items()}
    echoed = {
        field: by_id[id(seen.tensors[field])]
        for field in planned.keys
        if field not in planned.copied
        and id(seen.tensors[field]) in by_id
        and seen.tensors[field] is crossing[by_id[id(seen.tensors[field])]]
    }
    if not echoed:
        return planned
    keys = {field: echoed.get(field, key) for field, key in planned.keys.items()}
    return dataclasses.replace(planned, keys=keys, echoed=echoed)


def _sharing(planned: CachedCall, seen: Any) -> CachedCall:
    """``planned`` with each stored field that is an earlier stored field's very tensor keyed
    by that field's key (:attr:`CachedCall.shared`)."""
    first_of: dict[int, str] = {}
    shared = {}
    for field in planned.keys:
        if field in planned.echoed or field in planned.copied:
            continue
        earlier = first_of.setdefault(id(seen.tensors[field]), field)
        if earlier != field:
            shared[field] = earlier
    if not shared:
        return planned
    keys = {field: planned.keys[shared.get(field, field)] for field in planned.keys}
    return dataclasses.replace(planned, keys=keys, shared=shared)


def stored_verdict(
    verdict: CallVerdict, inner: dict[CallId, CallId | None], stored: dict[CallId, CachedCall]
) -> Any:
    call = (verdict.path, verdict.index)
    if call in stored and (stored[call].unread or stored[call].echoed or stored[call].shared):
        planned = stored[call]
        total = len(planned.keys) + len(planned.unread)
        parts = []
        if planned.unread:
            parts.append(
                f"stores {len(planned.keys) - len(planned.echoed)} of its {total} output "
                f"fields; not stored, stage 2 never computes with them: "
                f"{', '.join(planned.unread)}"
            )
        if planned.echoed:
            echoes = ", ".join(
                f"{field} (the input {name})" for field, name in planned.echoed.items()
            )
            parts.append(f"not stored again, the step's own inputs it returns: {echoes}")
        if planned.shared:
            shares = ", ".join(f"{field} (is {other})" for field, other in planned.shared.items())
            parts.append(f"stored once, the same tensor as another field: {shares}")
        detail = "; ".join(parts)
        detail = f"{verdict.detail}; {detail}" if verdict.detail else detail
        return dataclasses.replace(verdict, detail=detail)
    if call not in inner:
        return verdict
    reader = inner[call]
    detail = (
        f"not stored: only {reader[0]} call {reader[1]}, itself cached, reads its output"
        if reader is not None
        else "not stored: the step never reads its output"
    )
    return dataclasses.replace(verdict, detail=detail)
