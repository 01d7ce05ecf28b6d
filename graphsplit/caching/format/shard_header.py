"""A shard's safetensors header against the manifest's record of it: pure comparison.

The table is the shard's checked header (:class:`~graphsplit.caching.format.tensor_places.
TensorTable`, read by the one strict parser every reader uses); opening the file is the
store's, so the same comparison serves a local, a mapped, a read-through and a remote shard.

Glossary:
    tensor problem: a shard whose header names other tensors, shapes or dtypes than the
        manifest's rows, or whose embedded sample keys (metadata ``graphsplit_keys``) are not
        the record's; one line, in words, or None when the shard holds what it should.
    expected tensors: per row ``r`` and per-sample boundary tensor ``name``, the tensor
        ``"{r}/{name}"`` of the row's recorded shape (permuted to memory order where the row
        was stored in one) and the header's storage dtype.

In and out::

    shard_tensors_problem(table, record, manifest) -> str | None
"""

from __future__ import annotations

import json

from graphsplit.caching.format.layout import Manifest, ShardRecord, tensor_name
from graphsplit.caching.format.memory_order import row_order
from graphsplit.caching.format.tensor_file import SAFETENSORS_DTYPES
from graphsplit.caching.format.tensor_places import TensorTable

__all__ = ["shard_tensors_problem"]


def shard_tensors_problem(
    table: TensorTable, record: ShardRecord, manifest: Manifest
) -> str | None:
    """Whether a shard's tensors are exactly the rows the manifest lists, in their shapes."""
    header = manifest.header
    specs = header.sample_specs
    expected = {}
    for row, (shapes, orders) in enumerate(zip(record.shapes, record.row_orders)):
        for spec, shape, order in zip(specs, shapes, orders):
            if order is not None:  # stored in memory order
                assert spec.batch_dim is not None
                shape = tuple(shape[d] for d in row_order(order, spec.batch_dim))
            expected[tensor_name(row, spec.name)] = (shape, header.stored_dtype(spec))
    names = set(table.places)
    if names != set(expected):
        unexpected = sorted(names - set(expected))
        absent = sorted(set(expected) - names)
        return (
            f"its tensors differ from the manifest's (absent: {absent[:3]}, "
            f"extra: {unexpected[:3]})"
        )
    for name, (shape, dtype) in expected.items():
        place = table.places[name]
        if place.shape != shape or place.dtype != dtype:
            return (
                f"tensor {name!r} is {SAFETENSORS_DTYPES[place.dtype]} {place.shape}, the "
                f"manifest records {dtype} {shape}"
            )
    try:
        embedded = json.loads(table.metadata_strings.get("graphsplit_keys", "null"))
    except ValueError:
        embedded = None
    if embedded != list(record.keys):
        return (
            "the sample keys written inside it differ from the manifest's (a shard of another "
            "cache, or of another place in this one)"
        )
    return None
