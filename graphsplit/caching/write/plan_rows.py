"""Which plan made each row: a cache of several shape signatures (see :mod:`graphsplit.signatures`).

A split makes a plan per shape signature; one ``cache()`` writes the rows of every plan. Each
shard that holds a row of a plan other than the first records every row's plan (its signature
key) and the plans it used; the manifest gathers them (``Manifest.plans``). A cache of the
first plan alone records nothing, so it is what it always was.

In and out::

    note_plan(pending, split, plan, rows)      # the batch's rows are ``plan``'s
    plan_record(plan) -> PlanRecord            # signature, example and stage-1 code digest
    run_stage1(split, batch, size, device, header) -> (outputs, plan)   # checked outputs
    refuse_other_boundary(plan, header)        # one cache: the same boundary tensors
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from graphsplit.caching.format.fingerprint import fingerprint
from graphsplit.caching.format.layout import CacheHeader, ConstantsRecord, PlanRecord
from graphsplit.caching.loader.batches import as_mapping
from graphsplit.errors import CacheError, Fix, user_error
from graphsplit.signatures.defaults import (
    batch_input_names,
    refuse_missing_given,
    refuse_unread_values,
)
from graphsplit.signatures.names import short_name

__all__ = ["note_plan", "plan_record", "refuse_other_boundary", "run_stage1"]


def note_plan(
    pending: Any,
    split: Any,
    plan: Any,
    rows: int,
    constants_of: Callable[[str], ConstantsRecord | None] = lambda key: None,
) -> None:
    """Record the batch's plan per row; a shard of the first plan's rows only records none,
    unless that plan has a constants file of its own (``constants_of``, see
    :mod:`~graphsplit.caching.write.plan_constants`)."""
    plan_set = getattr(split, "plan_set", None)
    if plan is None or plan_set is None:
        return
    pending.signatures += [plan.key] * rows
    own = constants_of(plan.key) is not None
    if plan is not plan_set.first or pending.plans or own:
        for key in dict.fromkeys(pending.signatures):
            if key not in pending.plans:
                pending.plans[key] = plan_record(plan_set.plans[key], constants_of(key))


def plan_record(plan: Any, constants: ConstantsRecord | None = None) -> PlanRecord:
    """A plan as the cache records it (a :class:`~graphsplit.caching.format.layout.PlanRecord`),
    with its own ``constants`` file if it has one."""
    code = fingerprint(plan, allow_meta=True).code
    return PlanRecord(
        signature=plan.signature.to_json(),
        example=plan.example or "",
        code=code,
        constants=constants,
    )


def run_stage1(
    split: Any,
    batch: Any,
    size: int,
    device: torch.device | None,
    header: CacheHeader,
    *,
    mode: Any = torch.inference_mode,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Stage 1's outputs for the batch, and the plan that made them (None: a split without
    plans, run as its ``stage1``). ``mode`` is the grad mode it runs under: a live cache
    passes ``torch.no_grad``, since stage 2 trains on the same outputs (autograd cannot save
    inference tensors)."""
    refuse_unread_values(batch, split)
    refuse_missing_given(batch, split)
    inputs = as_mapping(batch, batch_input_names(split))
    if device is not None:
        inputs = {
            name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()
        }
    plan_set = getattr(split, "plan_set", None)
    with mode():
        if plan_set is None:
            outputs, plan = split.stage1(**inputs), None
        else:
            outputs, plan = plan_set.run_stage1_signed(**inputs)
    if plan is not None and plan is not plan_set.first:
        refuse_other_boundary(plan, header)
    boundary = split.boundary if plan is None else plan.boundary
    if not isinstance(outputs, Mapping) or set(outputs) != set(boundary):
        found = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise user_error(
            CacheError,
            f"stage 1 returned {found}; the boundary is {list(split.boundary)}.",
            fix=Fix("pass the split whose stage 1 produced this boundary"),
        )
    for name, spec in boundary.items():
        value = outputs[name]
        if not isinstance(value, torch.Tensor):
            raise user_error(
                CacheError,
                f"stage 1 returned a {type(value).__name__} for {name!r}, not a tensor",
                fix=Fix("pass the split whose stage 1 produced this boundary"),
            )
        if spec.batch_dim is not None and (
            value.dim() <= spec.batch_dim or value.shape[spec.batch_dim] != size
        ):
            rows = value.shape[spec.batch_dim] if value.dim() > spec.batch_dim else 0
            folded = size > 0 and rows > size and rows % size == 0  # k rows per sample
            raise user_error(
                CacheError,
                f"stage 1 returned {name!r} with shape {tuple(value.shape)}, whose batch dim "
                f"{spec.batch_dim} should hold the batch's {size} samples."
                + (_FOLDED.format(rows=rows, per=rows // size) if folded else ""),
                fix=_FOLDED_FIX if folded else _UNBATCHED_FIX,
            )
    return dict(outputs), plan


_UNBATCHED_FIX = Fix(
    "batch every input along dim 0 (as a DataLoader does), with one 'key' per sample"
)
_FOLDED = (
    " It holds {rows} rows, {per} per sample: the collator stacks several rows per dataset "
    "item along dim 0 (TRL's preference collators stack each pair's chosen and rejected rows), "
    "and a cache row is one sample's."
)
_FOLDED_FIX = Fix(
    "give each sample's rows a dimension of their own (e.g. input_ids of shape (batch, 2, "
    "length), flattened in the step with .flatten(0, 1)), or keep them in separate fields "
    "(chosen_input_ids, rejected_input_ids), so that dim 0 holds one row per sample"
)


def refuse_other_boundary(plan: Any, header: CacheHeader) -> None:
    """One cache holds plans whose boundaries have the same tensors (names, dtypes, batch
    dims); only their sizes may differ."""
    theirs = [(s.name, s.dtype, s.batch_dim) for s in plan.boundary.values()]
    ours = [(s.name, s.dtype, s.batch_dim) for s in header.boundary]
    if theirs != ours:
        raise user_error(
            CacheError,
            f"the batch's plan ({short_name(plan.signature, example=plan.example)}) has another "
            "boundary than the cache's first "
            f"plan: {theirs} against {ours}; one cache holds plans whose boundaries differ in "
            "sizes only.",
            fix=Fix("cache the batches of this signature into a cache of their own"),
        )
