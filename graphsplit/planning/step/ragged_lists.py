"""Refuse batch fields that hold one tensor (or list / dict of tensors) per sample, ragged.

Detection and multi-image collate functions keep what cannot be stacked as a Python list with
one entry per sample: DETR's ``labels`` (a dict of ``boxes`` and ``class_labels`` per image,
each with as many rows as the image has objects), a list of images per sample, a list of
segment embeddings per sample. graphsplit's cache keys a row per sample along a tensor's batch
dim; such a list has no batch dim, so both paths saw it as a value of the whole batch: the
whole-step trace held it at the example's length (what the step built from it looked like a
per-dataset constant, stored once and handed to every batch), and the module-level path cached
it as one input of the plan. Neither lines up with the samples, so :func:`graphsplit.split`
refuses such a field before either path sees it, naming the field and the fix.

Glossary:
    field: one value of the example batch: a key of a dict batch, or a positional / keyword
        argument of the step.
    batch size: the first dim of the batch's first tensor field (``None`` where no field is a
        tensor).
    per-sample list: a ``list`` / ``tuple`` field whose every entry holds a tensor, with one
        entry per sample (its length is the batch size), whose entries are not themselves
        batched (a tensor whose first dim is the batch size).
    ragged: the entries' tensor shapes differ from sample to sample (3 boxes in one image, 5 in
        the next), so no stacking or batch dim can be inferred from them.

A list of batched tensors (``[view_a, view_b]``, each ``(B, ...)``) is not per-sample: the
module-level path caches each entry along its batch dim. A per-sample list whose entries all
have one shape is left to the paths (the trace refuses flat tensor lists, see
:mod:`graphsplit.planning.step.example_inputs`; a field the step ignores is harmless).

    ragged_fields(args, kwargs) -> list[RaggedField]
    refuse_ragged_lists(args, kwargs)   # SplitError naming the first ragged field
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from graphsplit.errors import Fix, SplitError, user_error

__all__ = ["RaggedField", "ragged_fields", "refuse_ragged_lists"]


@dataclass(frozen=True)
class RaggedField:
    """A per-sample list field whose entries' tensor shapes differ between samples."""

    name: str
    length: int
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # each entry's tensor shapes, in order


def ragged_fields(step: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[RaggedField]:
    """Every ragged per-sample list among the example batch's fields (``step``'s arguments)."""
    fields = list(_fields(_bound(step, args, kwargs)))
    batch = next(
        (int(v.shape[0]) for _, v in fields if isinstance(v, torch.Tensor) and v.dim() > 0),
        None,
    )
    found = []
    for name, value in fields:
        shapes = _per_sample_shapes(value, batch)
        if shapes is not None and len(set(shapes)) > 1:
            found.append(RaggedField(name, len(value), shapes))
    return found


def refuse_ragged_lists(step: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> None:
    """Raise :class:`~graphsplit.SplitError` naming the first ragged per-sample list field."""
    found = ragged_fields(step, args if isinstance(args, tuple) else (args,), kwargs or {})
    if not found:
        return
    field = found[0]
    shown = ", ".join(_shapes_text(shapes) for shapes in field.shapes[:4])
    more = ", ..." if field.length > 4 else ""
    raise user_error(
        SplitError,
        f"The batch field {field.name} is a list of {field.length} per-sample entries holding "
        f"tensors of different shapes ({shown}{more}). graphsplit caches a row per sample along "
        "a tensor's batch dim; a list has none, so the cached rows would not line up with the "
        "samples.",
        fix=Fix(
            f"pad and stack {field.name} into one tensor with a batch dim and a mask of the "
            "valid entries in your collate function (e.g. boxes of shape (batch, max_boxes, 4) "
            "and a bool boxes_mask, images of shape (batch, max_images, 3, H, W) and an "
            "image_mask); if the step does not read it, leave it out of the batch"
        ),
    )


def _bound(step: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The example batch by the step's parameter names (``args[i]`` where they do not bind)."""
    try:
        function = step.forward if isinstance(step, nn.Module) else step
        return dict(inspect.signature(function).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {**{f"args[{i}]": value for i, value in enumerate(args)}, **kwargs}


def _fields(inputs: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of each field: a dict argument's keys (``batch['boxes']``), else the
    argument itself."""
    for name, value in inputs.items():
        if isinstance(value, nn.Module):
            continue
        if isinstance(value, Mapping):
            yield from ((f"{name}[{key!r}]", item) for key, item in value.items())
        else:
            yield name, value


def _per_sample_shapes(
    value: Any, batch: int | None
) -> tuple[tuple[tuple[int, ...], ...], ...] | None:
    """Each entry's tensor shapes when ``value`` is a per-sample list, else ``None``."""
    if type(value) not in (list, tuple) or not value:
        return None
    entries = [
        [leaf for leaf in tree_leaves(entry) if isinstance(leaf, torch.Tensor)] for entry in value
    ]
    if not all(entries):
        return None
    rows = {
        entry.shape[0] if isinstance(entry, torch.Tensor) and entry.dim() else -1 for entry in value
    }
    if batch is None:  # no tensor field: entries sharing a first dim are batched fields
        if len(rows) == 1 and -1 not in rows:
            return None
    elif len(value) != batch or rows == {batch}:
        return None
    return tuple(tuple(tuple(leaf.shape) for leaf in leaves) for leaves in entries)


def _shapes_text(shapes: tuple[tuple[int, ...], ...]) -> str:
    return "/".join(str(tuple(shape)) for shape in shapes) if shapes else "()"
