"""A cache as a Hugging Face ``datasets`` dataset, and back: push it to the Hub, stream it.

:func:`to_hf_dataset` turns a cache folder into a ``datasets.Dataset`` with one row per sample:
a ``key`` column and one column per per-sample boundary tensor, holding the sample's row in its
logical shape (nested lists, so ``with_format("numpy")`` gives arrays of the right shape; rows
of different shapes, as aspect-ratio buckets make, are fine). :class:`HFCachedDataset` and
:class:`HFCachedIterable` read such a dataset (in memory, loaded from disk or parquet, or
streamed) back as :class:`~graphsplit.CachedDataset`-compatible items that
:func:`graphsplit.collate` batches for ``split.stage2``, bit for bit as the cache would.

Glossary:
    export record: the JSON that makes the dataset a graphsplit cache again: the cache's header
        (fingerprint, inputs, boundary, storage dtype) as ``manifest.json`` writes it, the
        storage errors, and the constants (a safetensors blob, base64). It is the ``id`` of the
        ``key`` column's feature, i.e. it lives in the dataset's *features* metadata, not in
        ``info.description``: ``datasets`` writes only the features into a parquet file's
        schema and into the Hub's dataset card, so ``description`` is lost on ``push_to_hub``,
        ``to_parquet`` and streaming, while the features travel with every copy
        (:mod:`graphsplit.caching.read.hf_record`).
    stored dtype: what the cache holds a tensor in. Arrow has no bfloat16, so a bfloat16 row is
        exported as float32 (an exact widening) and narrowed back on import; every other dtype
        is exported as it is.

Nothing here unpickles: the export record is strict JSON (read as strictly as
``manifest.json``), the constants are safetensors bytes, rows are Arrow numbers. A damaged
dataset is a graphsplit error naming what is wrong (:mod:`graphsplit.caching.read.hf_rows`);
the export writes as safely as ``cache()`` does (:mod:`graphsplit.caching.read.hf_destination`:
URLs stay URLs, a private staging folder, never a file graphsplit did not write, DiskFullError).

``datasets`` is an optional dependency, imported on first use; without it these functions raise
:class:`HFExportError` naming the extra to install.

In and out::

    to_hf_dataset(path, split=None, *, verify=True, cache_dir=None) -> datasets.Dataset
    export_cache(path, out, *, split=None, overwrite=False, parquet=False) -> Path | str
                                            to_hf_dataset written with save_to_disk / to_parquet,
                                            to a local path or a URL (s3://...)
    HFCachedDataset(dataset, split=None)    map-style; item i -> CachedSample; len; keys
    HFCachedIterable(dataset, split=None)   for a streamed datasets.IterableDataset
    export_record(dataset) -> ExportRecord  the record a dataset carries (header, constants)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphsplit.caching.format.records import to_json
from graphsplit.caching.read.bucket_sampler import regrouping_error
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.read.hf_destination import Destination
from graphsplit.caching.read.hf_record import (
    KEY_COLUMN,
    ORDERS_COLUMN,
    ExportRecord,
    HFExportError,
    arrow_dtype,
    export_record,
    exported_dtype,
)
from graphsplit.caching.read.hf_rows import HFCachedDataset, HFCachedIterable
from graphsplit.errors import Fix, user_error

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = [
    "ExportRecord",
    "HFCachedDataset",
    "HFCachedIterable",
    "HFExportError",
    "export_cache",
    "export_record",
    "to_hf_dataset",
]

PLAN_CONSTANTS_EXPORT_FIX = Fix(
    "train from the cache folder with graphsplit.CachedDataset (its loader gives each plan its "
    "constants), or cache each shape signature into a cache of its own to export it"
)


def _datasets() -> Any:
    """``import datasets`` on first use: it is an optional dependency."""
    try:
        import datasets
    except ImportError:
        raise user_error(
            HFExportError,
            "exporting a cache to Hugging Face datasets needs the `datasets` package, which is "
            "not installed.",
            fix=Fix("pip install 'graphsplit[datasets]' (or pip install datasets)"),
        ) from None
    return datasets


# ------------------------------------------------------------------------------------- export


def to_hf_dataset(
    path: str | Path,
    split: Split | None = None,
    *,
    verify: bool = True,
    cache_dir: str | Path | None = None,
) -> Any:
    """The cache at ``path`` as a ``datasets.Dataset``, one row per sample, in cache order.

    Args:
        path: a cache folder written by :func:`graphsplit.cache`.
        split: when given, refuse a cache this split did not make (as ``CachedDataset`` does).
        verify: check each shard's checksum while reading it.
        cache_dir: ``None`` builds the dataset in memory (nothing is written); a folder
            streams the rows into Arrow files there instead, for caches larger than memory
            (``datasets``' own cache format, named by the manifest's digest, so a changed
            cache is never served from an older export).

    The dataset's ``key`` feature carries the export record (the fingerprint among it; see the
    module glossary); ``info.description`` says in words where it came from. Push it with
    ``push_to_hub``, write it with ``to_parquet`` or ``save_to_disk``; read it back with
    :class:`HFCachedDataset` (or :class:`HFCachedIterable` when streamed).

    Raises:
        HFExportError: ``datasets`` is missing, a tensor's dtype has no Arrow type, the
            cache holds constants of several plans, or its stage 2 pairs rows by position
            (rows of an export are batched anew).
        CorruptCacheError, ManifestError, StaleCacheError: as ``CachedDataset`` raises them.
    """
    datasets = _datasets()
    cached = CachedDataset(path, split, verify=verify)
    if cached.paired_rows is not None:  # a row per sample: whoever reads it batches anew
        raise regrouping_error(
            cached.paired_rows,
            "an export to datasets (one row per sample, batched anew by whoever reads it)",
            (
                "train from the cache folder: graphsplit.CachedDataset(path, split).loader("
                f"batch_size={max(map(len, cached.stage1_batches or [()]))}) reads its stage-1 "
                "batches whole, which an export does not keep"
            ),
            HFExportError,
        )
    if cached.collation.plan_constants:  # the export record holds one set of constants
        raise user_error(
            HFExportError,
            f"the cache at {cached.path} holds per-dataset constants of several plans "
            f"({len(cached.collation.plan_constants) + 1} sets); an export carries one.",
            fix=PLAN_CONSTANTS_EXPORT_FIX,
        )
    header = cached.manifest.header
    specs = header.sample_specs
    stored = {spec.name: header.stored_dtype(spec) for spec in specs}
    for spec in (*specs, *header.constant_specs):
        dtype = stored.get(spec.name, spec.dtype)
        if arrow_dtype(dtype) is None:
            raise user_error(
                HFExportError,
                f"boundary tensor {spec.name!r} of the cache at {cached.path} is stored as "
                f"{dtype}, which Arrow (and so datasets) cannot hold exactly.",
                fix=Fix(
                    "keep this cache as a folder (graphsplit.CachedDataset), or re-cache with a "
                    "storage_dtype / boundary of float, int or bool tensors"
                ),
            )
    record = ExportRecord(header, cached.max_abs_error, cached.constants)
    constant_orders = (
        dict(cached.manifest.constants.dim_orders) if cached.manifest.constants else {}
    )
    features = {KEY_COLUMN: datasets.Value("string", id=record.to_json(constant_orders))}
    for spec in specs:
        feature: Any = datasets.Value(arrow_dtype(stored[spec.name]))
        for _ in range(len(spec.shape) - 1):  # a row has the batch dim removed
            feature = datasets.List(feature)
        features[spec.name] = feature
    orders = [order for shard in cached.manifest.shards for order in shard.row_orders]
    with_orders = any(any(row) for row in orders)
    if with_orders:
        features[ORDERS_COLUMN] = datasets.Value("string")

    def rows() -> Iterator[dict[str, Any]]:
        for index in range(len(cached)):
            item = cached[index]
            row: dict[str, Any] = {KEY_COLUMN: item["key"]}
            for spec in specs:
                value = item[spec.name].contiguous()
                value = value.to(exported_dtype(value.dtype))
                row[spec.name] = value.numpy()
            if with_orders:
                row[ORDERS_COLUMN] = json.dumps(
                    [None if order is None else list(order) for order in orders[index]]
                )
            yield row

    feature_set = datasets.Features(features)
    description = (
        f"graphsplit cache of {len(cached)} samples exported from {cached.path}; the cache's "
        f"fingerprint and header are in the features metadata (the {KEY_COLUMN!r} feature's id)"
    )
    if cache_dir is not None:
        manifest = json.dumps(to_json(cached.manifest), sort_keys=True).encode()
        digest = hashlib.sha256(manifest + features[KEY_COLUMN].id.encode()).hexdigest()
        dataset = datasets.Dataset.from_generator(
            rows, features=feature_set, cache_dir=str(cache_dir), fingerprint=digest[:32]
        )
        dataset.info.description = description
        return dataset
    columns: dict[str, list[Any]] = {name: [] for name in features}
    for row in rows():
        for name, value in row.items():
            columns[name].append(value)
    info = datasets.DatasetInfo(description=description, features=feature_set)
    return datasets.Dataset.from_dict(columns, features=feature_set, info=info)


def export_cache(
    path: str | Path,
    out: str | os.PathLike[str],
    *,
    split: Split | None = None,
    overwrite: bool = False,
    parquet: bool = False,
) -> Path | str:
    """Write the cache at ``path`` as a ``datasets`` dataset to ``out``; returns ``out`` (a
    Path, or the URL for a remote ``out``).

    ``out`` becomes a ``save_to_disk`` folder (read it with ``datasets.load_from_disk``), or
    with ``parquet=True`` one parquet file (``datasets.load_dataset("parquet", ...)``, which
    can stream it). Either then goes to the Hub with ``push_to_hub``. A URL (``s3://bucket/x``,
    any fsspec URL) is written there through fsspec; a local export is written in a private
    staging folder next to ``out`` and renamed into place, so a failed export leaves nothing
    and an earlier export stays whole until the new one is (see
    :mod:`graphsplit.caching.read.hf_destination`).

    Raises:
        HFExportError: ``out`` holds an earlier export (``error.remedy`` is
            :attr:`Remedy.OVERWRITE`), or anything else, which graphsplit never replaces.
        UnsupportedStorageError: ``out`` is a URL whose ``//`` was lost, or one fsspec cannot
            open. DiskFullError: no room (nothing is left behind). StorageError: the store
            failed.
    """
    destination = Destination.check(out, parquet=parquet, overwrite=overwrite)
    return destination.write(to_hf_dataset(path, split))
