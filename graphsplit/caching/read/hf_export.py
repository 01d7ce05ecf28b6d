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
        ``to_parquet`` and streaming, while the features travel with every copy.
    stored dtype: what the cache holds a tensor in. Arrow has no bfloat16, so a bfloat16 row is
        exported as float32 (an exact widening) and narrowed back on import; every other dtype
        is exported as it is.

Nothing here unpickles: the export record is strict JSON (read as strictly as
``manifest.json``), the constants are safetensors bytes, rows are Arrow numbers.

``datasets`` is an optional dependency, imported on first use; without it these functions raise
:class:`HFExportError` naming the extra to install.

In and out::

    to_hf_dataset(path, split=None, *, verify=True, cache_dir=None) -> datasets.Dataset
    export_cache(path, out, *, split=None, overwrite=False, parquet=False) -> Path
                                            to_hf_dataset written with save_to_disk / to_parquet
    HFCachedDataset(dataset, split=None)    map-style; item i -> CachedSample; len; keys
    HFCachedIterable(dataset, split=None)   for a streamed datasets.IterableDataset
    export_record(dataset) -> ExportRecord  the record a dataset carries (header, constants)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from graphsplit.caching.format.fingerprint import fingerprint, in_terms_of
from graphsplit.caching.format.layout import CacheHeader
from graphsplit.caching.format.memory_order import inverse
from graphsplit.caching.format.records import JsonReader, to_json
from graphsplit.caching.read.collation import CachedSample, Collation
from graphsplit.caching.read.dataset import CachedDataset, refuse_other_split
from graphsplit.errors import CacheError, Fix, ManifestError, Remedy, user_error

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

RECORD_FORMAT = "graphsplit-hf-export"
RECORD_VERSION = 1
KEY_COLUMN = "key"
ORDERS_COLUMN = "_graphsplit_dim_orders"  # present only when some row has a memory order
_WIDENED = {torch.bfloat16: torch.float32}  # Arrow has no bfloat16: exact widening
_ARROW_DTYPES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


class HFExportError(CacheError):
    """A cache cannot be exported to ``datasets``, or a dataset read back as a cache."""


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


@dataclass(frozen=True)
class ExportRecord:
    """What a dataset exported by :func:`to_hf_dataset` carries to become a cache again."""

    header: CacheHeader
    max_abs_error: Mapping[str, float]
    constants: Mapping[str, torch.Tensor]  # logical order, the dtype stage 2 takes

    def to_json(self, constant_orders: Mapping[str, Any]) -> str:
        physical = {}
        for name, value in self.constants.items():
            order = constant_orders.get(name)
            physical[name] = (value if order is None else value.permute(order)).contiguous()
        blob = save_safetensors(physical) if physical else b""
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "format_version": RECORD_VERSION,
                "header": to_json(self.header),
                "max_abs_error": dict(self.max_abs_error),
                "constants": base64.b64encode(blob).decode("ascii"),
                "constant_orders": {
                    k: (None if v is None else list(v)) for k, v in constant_orders.items()
                },
            },
            sort_keys=True,
        )


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
        HFExportError: ``datasets`` is missing, or a tensor's dtype has no Arrow type.
        CorruptCacheError, ManifestError, StaleCacheError: as ``CachedDataset`` raises them.
    """
    datasets = _datasets()
    cached = CachedDataset(path, split, verify=verify)
    header = cached.manifest.header
    specs = header.sample_specs
    stored = {spec.name: header.stored_dtype(spec) for spec in specs}
    for spec in (*specs, *header.constant_specs):
        dtype = stored.get(spec.name, spec.dtype)
        if _WIDENED.get(dtype, dtype) not in _ARROW_DTYPES:
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
        feature: Any = datasets.Value(
            _ARROW_DTYPES[_WIDENED.get(stored[spec.name], stored[spec.name])]
        )
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
                value = value.to(_WIDENED.get(value.dtype, value.dtype))
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
    out: str | Path,
    *,
    split: Split | None = None,
    overwrite: bool = False,
    parquet: bool = False,
) -> Path:
    """Write the cache at ``path`` as a ``datasets`` dataset to ``out``; returns ``out``.

    ``out`` becomes a ``save_to_disk`` folder (read it with ``datasets.load_from_disk``), or
    with ``parquet=True`` one parquet file (``datasets.load_dataset("parquet", ...)``, which
    can stream it). Either then goes to the Hub with ``push_to_hub``.

    Raises:
        HFExportError: ``out`` exists (``error.remedy`` is :attr:`Remedy.OVERWRITE`), or it is
            not a dataset of this kind, which graphsplit never deletes.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        kind = "file" if parquet else "folder"
        replaceable = (
            out.is_file() and not out.is_symlink()
            if parquet
            else out.is_dir() and not out.is_symlink() and (out / "state.json").is_file()
        )
        if not replaceable:
            raise user_error(
                HFExportError,
                f"{out} exists and is not a {'parquet file' if parquet else 'saved dataset'} "
                "graphsplit may replace.",
                fix=Fix(f"choose a new {kind} to write, or move {out} away"),
            )
        if not overwrite:
            raise user_error(
                HFExportError,
                f"{out} already holds an exported dataset.",
                fix=Fix(
                    "pass {remedy} to replace it, or choose another destination",
                    Remedy.OVERWRITE,
                ),
            )
    dataset = to_hf_dataset(path, split)
    partial = out.with_name(out.name + ".partial")  # the old export stays until the new is whole
    if partial.is_dir() and not partial.is_symlink():
        shutil.rmtree(partial)
    if parquet:
        dataset.to_parquet(str(partial))
    else:
        dataset.save_to_disk(str(partial))
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(partial, out)
    return out


# ------------------------------------------------------------------------------------- import


def export_record(dataset: Any) -> ExportRecord:
    """The export record a dataset made by :func:`to_hf_dataset` carries.

    Raises:
        ManifestError: the dataset has no record (it was not exported by graphsplit) or a
            malformed one, naming what is wrong.
    """
    features = getattr(dataset, "features", None) or {}
    key = features.get(KEY_COLUMN) if hasattr(features, "get") else None
    text = getattr(key, "id", None)
    where = "the dataset's features metadata (the 'key' feature's id)"
    if not text:
        raise user_error(
            ManifestError,
            f"this dataset carries no graphsplit export record in {where}, so it is not a cache "
            "exported by graphsplit.",
            fix=Fix(
                "export the cache with graphsplit.caching.read.hf_export.to_hf_dataset(path), and "
                "keep its features (select or map columns without dropping 'key')"
            ),
        )
    try:
        document = json.loads(text)
    except ValueError as error:
        raise user_error(
            ManifestError,
            f"the export record in {where} is not JSON ({error}).",
            fix=Fix("export the cache again"),
        ) from None
    if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
        raise user_error(
            ManifestError,
            f"the record in {where} is not a graphsplit export record.",
            fix=Fix("export the cache again with to_hf_dataset"),
        )
    if document.get("format_version") != RECORD_VERSION:
        raise user_error(
            ManifestError,
            f"the export record in {where} has format_version {document.get('format_version')!r}; "
            f"this graphsplit reads {RECORD_VERSION}.",
            fix=Fix("read it with the graphsplit version that exported it, or export again"),
        )
    reader = JsonReader(Path("<datasets features metadata>"))
    header = reader.read(CacheHeader, document.get("header"), "header")
    errors = reader.mapping(document.get("max_abs_error", {}), "max_abs_error")
    orders = reader.mapping(document.get("constant_orders", {}), "constant_orders")
    try:
        blob = base64.b64decode(document.get("constants", ""), validate=True)
        physical = load_safetensors(blob) if blob else {}
    except Exception as error:  # binascii and safetensors raise their own types
        raise user_error(
            ManifestError,
            f"the constants in {where} cannot be read ({error}).",
            fix=Fix("export the cache again"),
        ) from None
    constants = {}
    for spec in header.constant_specs:
        if spec.name not in physical:
            raise user_error(
                ManifestError,
                f"the export record in {where} lacks the constant {spec.name!r}.",
                fix=Fix("export the cache again"),
            )
        value, order = physical[spec.name], orders.get(spec.name)
        if order is not None:
            value = value.permute(inverse(tuple(order)))
        constants[spec.name] = value.to(spec.dtype)
    return ExportRecord(header, {k: float(v) for k, v in errors.items()}, constants)


class _Rows:
    """Turns rows of an exported dataset into :class:`CachedSample` items collate batches."""

    def __init__(self, dataset: Any, split: Split | None) -> None:
        self.record = export_record(dataset)
        header = self.record.header
        names = set(getattr(dataset, "column_names", None) or dataset.features)
        missing = [spec.name for spec in header.sample_specs if spec.name not in names]
        if missing:
            raise user_error(
                ManifestError,
                f"the dataset lacks the column(s) {missing} that its export record lists.",
                fix=Fix(
                    "keep every column of the exported dataset (drop none with select_columns / "
                    "remove_columns)"
                ),
            )
        if split is not None:
            current = in_terms_of(fingerprint(split, allow_meta=True), header.fingerprint, split)
            refuse_other_split(_HeaderOnly(header), current, Path("<the datasets dataset>"))
        self.stored = {spec.name: header.stored_dtype(spec) for spec in header.sample_specs}
        self.collation = Collation(
            path=Path("<datasets>"),
            rows=tuple((spec.name, spec.batch_dim, spec.dtype) for spec in header.sample_specs),
            constants=self.record.constants,
            order=tuple(spec.name for spec in header.boundary),
        )

    def item(self, row: Mapping[str, Any]) -> CachedSample:
        item = CachedSample(key=str(row[KEY_COLUMN]))
        item.collation = self.collation
        for name, dtype in self.stored.items():
            array = np.asarray(row[name], dtype=_ARROW_DTYPES[_WIDENED.get(dtype, dtype)])
            item[name] = torch.from_numpy(array).to(dtype)
        text = row.get(ORDERS_COLUMN)
        if text:
            orders = json.loads(text)
            item.dim_orders = tuple(None if o is None else tuple(o) for o in orders)
        return item


@dataclass(frozen=True)
class _HeaderOnly:
    """What :func:`~graphsplit.caching.read.dataset.refuse_other_split` reads of a manifest:
    its header."""

    header: CacheHeader


class HFCachedDataset(torch.utils.data.Dataset):
    """A ``datasets.Dataset`` exported by :func:`to_hf_dataset`, read as a cache.

    Item ``i`` is the same :class:`~graphsplit.caching.read.collation.CachedSample` the cache folder
    gives (same key, rows, dtypes and memory orders), so ``DataLoader(..., collate_fn=
    graphsplit.collate)`` feeds ``split.stage2`` exactly as from the folder. With ``split``,
    a dataset this split did not make is refused (``StaleCacheError``), as ``CachedDataset``
    refuses a folder.
    """

    def __init__(self, dataset: Any, split: Split | None = None) -> None:
        self._rows = _Rows(dataset, split)
        self.dataset = dataset.with_format("numpy")
        self.keys: list[str] = [str(key) for key in dataset[KEY_COLUMN]]

    @property
    def header(self) -> CacheHeader:
        """The cache's header; ``header.fingerprint`` is the cache's fingerprint."""
        return self._rows.record.header

    @property
    def constants(self) -> Mapping[str, torch.Tensor]:
        return self._rows.record.constants

    @property
    def max_abs_error(self) -> Mapping[str, float]:
        return self._rows.record.max_abs_error

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> CachedSample:
        return self._rows.item(self.dataset[int(index)])


class HFCachedIterable(torch.utils.data.IterableDataset):
    """A streamed ``datasets.IterableDataset`` exported by :func:`to_hf_dataset`, read as a
    cache: it yields the same items as :class:`HFCachedDataset`, in order."""

    def __init__(self, dataset: Any, split: Split | None = None) -> None:
        self._rows = _Rows(dataset, split)
        self.dataset = dataset

    @property
    def header(self) -> CacheHeader:
        return self._rows.record.header

    def __iter__(self) -> Iterator[CachedSample]:
        for row in self.dataset:
            yield self._rows.item(row)
