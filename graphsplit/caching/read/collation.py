"""Batching cached samples for stage 2: the items a cache yields, and how they are stacked.

Glossary:
    item (:class:`CachedSample`): one sample, ``{"key": str, name: row tensor, ...}``, as a
        :class:`~graphsplit.caching.read.dataset.CachedDataset` or an exported Hugging Face
        dataset yields it; a plain dict that also carries its :class:`Collation`.
    collation: what batching items of one cache needs: each row tensor's batch dim and the
        dtype stage 2 takes, the cache's constants and the boundary's order.
    memory order: the order of dims in memory of the batch a row was computed in (None: plain
        contiguous); rows of one batch share theirs, and the batch is rebuilt with stage 1's
        strides (:mod:`graphsplit.caching.format.memory_order`).
    padded row: a row whose trailing zeros along one dim carry nothing (its boundary spec's
        ``pad_dim``: captions as code points, as wide as the longest caption of the batch
        stage 1 saw, which stage 2 decodes back to the very strings, zeros to nothing). Rows
        of different sizes there share a bucket, and :func:`collate` pads them with zeros to
        the batch's widest. Every other row is batched only with rows of its own shape.

In and out::

    collate(items) -> dict[str, Tensor]     # the keyword arguments of split.stage2
    CachedSample(key=..., **rows)           .collation  .dim_orders
    Collation(path, rows, constants, order, plan_constants={}, padded={})
    padded_dims(specs) -> {name: row dim}   # the padded rows of a header's sample specs
    bucket_key(shapes, pads) -> shapes, a padded row's padded size None
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.format.layout import Manifest
from graphsplit.caching.format.memory_order import Order, inverse, row_order
from graphsplit.caching.store.remote import RemotePath
from graphsplit.errors import CacheError, Fix, user_error
from graphsplit.signatures.signature import SIGNATURE_KEY
from graphsplit.units import some_keys

__all__ = [
    "MIXED_SHAPES_FIX",
    "CachedSample",
    "Collation",
    "bucket_key",
    "collate",
    "padded_dims",
    "sample_signatures",
]


MIXED_SHAPES_FIX = Fix(
    "batch samples of one shape together: cached.loader(batch_size, seed=0), for cached = "
    "CachedDataset(path, split), batches the cache by shape (or DataLoader(cached, batch_sampler="
    "graphsplit.BucketBatchSampler(cached, batch_size), collate_fn=graphsplit.collate)); to "
    "have fewer shapes, pad the raw data in stage 1 to a multiple (pad_to_multiple_of=...)"
)


@dataclass(frozen=True)
class Collation:
    """What :func:`collate` needs to batch items of one cache: batch dims, dtypes, constants."""

    path: Path | RemotePath
    rows: tuple[tuple[str, int, torch.dtype], ...]  # (name, batch dim, dtype stage 2 takes)
    constants: Mapping[str, torch.Tensor]
    order: tuple[str, ...]
    # A plan's own constants (by signature key) where they are not ``constants``: a cache of
    # several plans whose constants differ (see caching.write.plan_constants).
    plan_constants: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    # The padded rows (see the glossary): by name, the row's dim that zeros pad.
    padded: Mapping[str, int] = field(default_factory=dict)

    def constants_of(self, signature: str | None) -> Mapping[str, torch.Tensor]:
        """The constants of the plan ``signature`` (None: a cache of one plan)."""
        if signature is None:
            return self.constants
        return self.plan_constants.get(signature, self.constants)


class CachedSample(dict):
    """One item of a :class:`CachedDataset`: a plain dict that also knows how to batch it.

    ``dim_orders`` holds, per row tensor, the memory order of the batch it was computed in
    (None: plain contiguous), so :func:`collate` rebuilds batches with stage 1's strides.
    """

    collation: Collation | None = None
    dim_orders: tuple[Order | None, ...] | None = None
    # The sample's plan (signature key) in a cache of several plans; None in a cache of one.
    signature: str | None = None


def padded_dims(specs: Iterable[BoundarySpec]) -> dict[str, int]:
    """The padded rows among per-sample ``specs``: by name, the dim of the row (the batch
    dim removed) that zeros pad, from each spec's ``pad_dim``."""
    return {
        spec.name: spec.pad_dim - (spec.batch_dim < spec.pad_dim)
        for spec in specs
        if spec.pad_dim is not None and spec.batch_dim is not None
    }


def bucket_key(
    shapes: Sequence[tuple[int, ...]], pads: Sequence[int | None]
) -> tuple[tuple[int | None, ...], ...]:
    """A sample's rows' ``shapes`` as its bucket knows them: a padded row's size along its
    ``pads`` dim is None (any size batches), every other size as it is."""
    return tuple(
        shape if pad is None else (*shape[:pad], None, *shape[pad + 1 :])
        for shape, pad in zip(shapes, pads)
    )


def sample_signatures(manifest: Manifest) -> list[str | None]:
    """Each sample's plan in a cache of several plans (rows of a shard that records none are
    the first plan's); ``None`` for every sample of a cache of one plan."""
    if not manifest.plans:
        return [None] * manifest.num_samples
    first = manifest.first_plan
    return [
        key for shard in manifest.shards for key in (shard.signatures or (first,) * len(shard.keys))
    ]


def collate(items: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack :class:`CachedDataset` items into the keyword arguments of ``split.stage2``.

    Each row is stacked along its tensor's batch dim, straight from the shard's memory map
    into the batch in the dtype stage 2 takes (a lower ``storage_dtype`` is undone in the same
    copy); the constants of the samples' plan are added. Samples in
    one batch must have rows of the same shapes: a cache of several shapes is batched by
    :meth:`CachedDataset.loader` (or a :class:`~graphsplit.BucketBatchSampler`). Padded rows
    (captions as code points, see the glossary) are padded with zeros to the batch's widest.

    Example:
        >>> loader = DataLoader(cached, batch_size=8, collate_fn=graphsplit.collate)
        ... # doctest: +SKIP
        >>> loss = split.stage2(**next(iter(loader)))  # doctest: +SKIP
    """
    if not items:
        raise ValueError("graphsplit.collate needs at least one item")
    collation = getattr(items[0], "collation", None)
    if collation is None:
        raise user_error(
            CacheError,
            f"graphsplit.collate got a {type(items[0]).__name__}, not an item of a "
            "graphsplit.CachedDataset (those carry the batch dims and constants it needs).",
            fix=Fix("index a CachedDataset, or stack the tensors yourself"),
        )
    if any(getattr(item, "collation", None) is not collation for item in items):
        paths = {str(getattr(getattr(item, "collation", None), "path", "?")) for item in items}
        raise user_error(
            CacheError,
            f"graphsplit.collate got items of different caches {sorted(paths)}.",
            fix=Fix("batch each cache apart"),
        )
    batch: dict[str, torch.Tensor] = {}
    for column, (name, batch_dim, dtype) in enumerate(collation.rows):
        rows = [item[name] for item in items]
        if name in collation.padded:
            rows = _zero_padded(rows, collation.padded[name])
        if len({tuple(row.shape) for row in rows}) > 1:
            raise user_error(
                CacheError,
                _mixed_shapes_reason(name, items, rows),
                fix=MIXED_SHAPES_FIX,
            )
        order = _batch_order(name, column, batch_dim, items)
        if order is None:
            batch[name] = _stack(rows, batch_dim, dtype)
        else:  # stack in memory order, then view in logical order: stage 1's strides
            within = row_order(order, batch_dim)
            physical = [row.permute(within) for row in rows]
            stacked = _stack(physical, order.index(batch_dim), dtype)
            batch[name] = stacked.permute(inverse(order))
    signatures = {getattr(item, "signature", None) for item in items}
    if len(signatures) > 1:
        raise user_error(
            CacheError,
            f"graphsplit.collate got samples of {len(signatures)} plans in one batch; stage 2 "
            "runs one plan per batch.",
            fix=Fix("batch with cached.loader(batch_size), whose batches hold one plan each"),
        )
    (signature,) = signatures
    batch.update(collation.constants_of(signature))
    ordered: dict[str, Any] = {name: batch[name] for name in collation.order}
    if signature is not None:  # names the batch's plan for split.stage2's dispatch
        ordered[SIGNATURE_KEY] = signature
    return ordered


def _zero_padded(rows: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """``rows`` padded with zeros at the end of ``dim`` to the widest of them (a row already
    that wide as it is). Only padded rows come here: their trailing zeros carry nothing."""
    if any(row.dim() <= dim for row in rows):
        return rows  # not rows of the recorded rank: the shape check names them
    widest = max(int(row.shape[dim]) for row in rows)
    padded = []
    for row in rows:
        missing = widest - int(row.shape[dim])
        if missing:
            shape = (*row.shape[:dim], missing, *row.shape[dim + 1 :])
            row = torch.cat([row, row.new_zeros(shape)], dim=dim)
        padded.append(row)
    return padded


def _stack(rows: Sequence[torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.stack(rows, dim).to(dtype)`` in one pass: rows in a lower storage dtype are
    widened as they are copied from the shard's map into the batch, not stacked then cast."""
    if rows[0].dtype == dtype:
        return torch.stack(rows, dim=dim)
    shape = list(rows[0].shape)
    shape.insert(dim, len(rows))
    return torch.stack(rows, dim=dim, out=torch.empty(shape, dtype=dtype))


def _batch_order(
    name: str, column: int, batch_dim: int, items: Sequence[Mapping[str, Any]]
) -> Order | None:
    """The memory order of a batch of ``items``' rows of tensor ``name``.

    Rows must share their own memory order. Batches of one sample record no place for the
    batch dim (its stride means nothing), so a recorded order wins over None.
    """
    orders = [
        None if getattr(item, "dim_orders", None) is None else item.dim_orders[column]
        for item in items
    ]
    within = {None if order is None else row_order(order, batch_dim) for order in orders}
    within = {None if order == tuple(sorted(order or ())) else order for order in within}
    if len(within) > 1:
        by_layout: dict[str, list[str]] = {}
        for item, order in zip(items, orders):
            layout = None if order is None else row_order(order, batch_dim)
            layout = None if layout == tuple(sorted(layout or ())) else layout
            by_layout.setdefault("contiguous" if layout is None else str(layout), []).append(
                str(item.get("key"))
            )
        listed = "; ".join(
            f"{layout} for {some_keys(keys, 3)}" for layout, keys in by_layout.items()
        )
        raise user_error(
            CacheError,
            f"cannot batch {name!r}: its samples were stored in different memory layouts "
            f"({listed}). Stage 1 computed them in batches of different sizes (a bucket's "
            "shorter last batch: a convolution returns channels-last at batch 2 and contiguous "
            "at 1), and stage 2's random draws follow the layout, so this batch would not "
            "train as the unsplit step.",
            fix=Fix(
                "cache and train with the same batch size and drop_last=True in both samplers "
                "(or buckets holding a multiple of the batch size), so every batch holds rows "
                "stage 1 computed at the batch size stage 2 trains with"
            ),
        )
    recorded = [order for order in orders if order is not None]
    return max(recorded, key=recorded.count) if recorded else None


def _mixed_shapes_reason(
    name: str, items: Sequence[Mapping[str, Any]], rows: Sequence[torch.Tensor]
) -> str:
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for item, row in zip(items, rows):
        by_shape.setdefault(tuple(row.shape), []).append(str(item.get("key")))
    listed = "; ".join(f"{shape} for {some_keys(keys, 3)}" for shape, keys in by_shape.items())
    return (
        f"cannot batch {name!r}: the samples have different shapes: {listed}. graphsplit does "
        "not pad cached rows to a batch's longest: a row's frozen values were computed at its "
        "own batch's padding, and rows padded after the fact are not shown to give the unsplit "
        'step\'s loss (docs/howto.md, "Datasets of many shapes").'
    )
