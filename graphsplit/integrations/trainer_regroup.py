"""The trainer's split, made before the padding groups are final, and the groups it allows.

:func:`~.trainer_groups.padding_groups` groups samples by the padded shape of every tensor the
collator returns, before any model runs. Some of those tensors the loss reads only the shape
of: TRL's ``DataCollatorForChatML`` pads ``prompts`` to the batch's longest prompt, and GKD's
``compute_loss`` reads ``prompts.shape[1]`` alone (the plan keeps ``prompts__shape``, no
values). Grouping on them too splits samples of one sequence length by prompt length, down to
batches of one sample. So the loss is split first, on the first batch of the full grouping,
and the groups are keyed again without the **shape-only fields**: the inputs the plan leaves
out of the cache (``kind == "unstored"``: only cached calls compute with them) whose padding
does not move any row stage 1 stores.

Exact: in a training batch of one group the grouped fields are padded as each sample alone
(as when cached), and a shape-only field to the longest of the samples' own (checked on each
group's first batch and every caching batch; :class:`~.trainer_groups.PaddingGroups`), which
is the shape the plain trainer's collator gives that batch. Stage 2 never reads the field's
values, only its shape, which it takes from the batch's rows of ``<name>__shape``: those are
rebuilt for each training batch (:meth:`~.trainer_groups.PaddingGroups.shape_rows`) instead of
the ones each sample's caching batch stored. What the shape-only field's padding must not
change is stage 1's stored rows, since a cached sample is read in batches padded otherwise:
a cached call may read the field's values, or the step may slice a cached call's input by its
length, which no trace of tensors sees. So each candidate is tried: stage 1 runs on the
example batch with that field grown by one in every dimension but the batch's, and a field
that changes any other stored row (or makes stage 1 fail) stays grouped on.

In and out::

    planned = plan_groups(trainer, groups)   # -> Planned(loss, example, split, groups)
    shape_only_fields(split, example)        # -> {"prompts": "prompts__shape", ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from graphsplit.api import Split, split
from graphsplit.calls.call_plan import CallPlan
from graphsplit.integrations.trainer_checks import caching_loader, dataset_and_collator
from graphsplit.integrations.trainer_groups import PaddingGroups, regroup
from graphsplit.integrations.trainer_loss import TrainerLoss

__all__ = ["Planned", "first_batch", "plan_groups", "shape_only_fields"]


@dataclass(frozen=True)
class Planned:
    """The loss module, the example batch it was split on, the split, the final groups."""

    loss: TrainerLoss
    example: dict[str, Any]
    split: Split
    groups: PaddingGroups | None


def plan_groups(trainer: Any, groups: PaddingGroups | None) -> Planned:
    """Split the trainer's loss on the first caching batch of ``groups`` (every field grouped
    on), then key the groups without the shape-only fields (``None`` stays ``None``: every
    sample has one shape). The caller keeps the generators and the trainer's bookkeeping."""
    loss = TrainerLoss(trainer)
    example = first_batch(caching_loader(trainer, groups))
    parts = split(loss, (example,))
    if groups is not None:
        dataset, collator = dataset_and_collator(trainer, "graphsplit cache")
        fields = shape_only_fields(parts, example)
        groups = regroup(groups, fields, dataset, collator, trainer._train_batch_size)
    return Planned(loss=loss, example=example, split=parts, groups=groups)


def first_batch(loader: DataLoader) -> dict[str, Any]:
    """The first caching batch without its sample keys: the step's ``inputs``."""
    batch = next(iter(loader))
    return {name: value for name, value in batch.items() if name != "key"}


def shape_only_fields(parts: Split, example: dict[str, Any]) -> dict[str, str]:
    """The example's fields the plan keeps only the shape of and whose padding leaves every
    other row stage 1 stores as it was: field -> the boundary key of its shape. Empty for a
    split without a module-level plan (the whole-step trace stores what it reads)."""
    plan = getattr(parts, "plan", None)
    if not isinstance(plan, CallPlan):
        return {}
    candidates = {
        spec.name: spec.field
        for spec in plan.inputs
        if spec.kind == "unstored" and isinstance(example.get(spec.name), torch.Tensor)
    }
    if not candidates:
        return {}
    example = _on_stage1_device(parts, example)
    with torch.inference_mode():
        stored = parts.stage1(**example)
        return {
            name: key
            for name, key in candidates.items()
            if _rows_kept(parts, {**example, name: _grown(example[name])}, stored, key)
        }


def _rows_kept(
    parts: Split, grown: dict[str, Any], stored: dict[str, torch.Tensor], shape_key: str
) -> bool:
    """Whether stage 1 on the grown batch stores every row but ``shape_key`` bit for bit as on
    the example."""
    try:
        rows = parts.stage1(**grown)
    except Exception:  # the field's padding reaches what stage 1 computes: it stays grouped
        return False
    if rows.keys() != stored.keys():
        return False
    return all(
        rows[key].dtype == stored[key].dtype and torch.equal(rows[key], stored[key])
        for key in stored
        if key != shape_key
    )


def _grown(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` padded with zeros by one in every dimension but the batch's."""
    grown = tensor.new_zeros((tensor.shape[0], *(size + 1 for size in tensor.shape[1:])))
    grown[tuple(slice(0, size) for size in tensor.shape)] = tensor
    return grown


def _on_stage1_device(parts: Split, example: dict[str, Any]) -> dict[str, Any]:
    """The example's tensors where stage 1's weights are, as ``cache()`` runs it."""
    device = next((tensor.device for tensor in parts.stage1.parameters()), None)
    if device is None:
        return example
    return {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in example.items()
    }
