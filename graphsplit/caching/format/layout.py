"""The on-disk format of a cache folder, described once: file names, records, and their rules.

A cache folder holds::

    manifest.json              Manifest, written last, atomically: the cache is complete iff
                               it exists
    constants.safetensors      per-dataset constants (boundary tensors without a batch dim)
    shard-00000.safetensors    per-sample rows, tensor names "{row}/{boundary name}"
    .partial/header.json       while writing: the CacheHeader the run started with (for resume;
                               graphsplit 0.1 named it .partial/plan.json, still read)
    .partial/shard-00000.json  while writing: ShardProgress, one per finished shard
    .partial/constants.json    while writing: ConstantsProgress, once the constants are written
    .lock                      the writer's flock (an object store: a lock object, see
                               caching.store.remote_lock); names its pid and host

Glossary:
    header: what a run was started with (fingerprint, inputs, boundary, storage, shard layout);
        the resume header and the manifest both hold it, so a resumed run can check that it
        continues the same cache.
    shard layout: shard ``k`` holds the rows of loader batches ``k * batches_per_shard`` up to
        the next multiple, which makes the layout a pure function of the loader's order and
        lets resumed and multi-process runs write the same files as one uninterrupted process.
    shard record: one shard's file name, checksum, size and its samples (keys, per-tensor shapes,
        memory orders, input digests) in row order; the manifest lists them in shard order, so
        sample ``i`` of the cache is the ``i``-th row counted across shards.
    progress record: what a run notes in ``.partial/`` when a shard (or the constants file) is
        finished: its record, plus the loader positions and storage errors that resuming and
        finishing need and the manifest does not keep.
    stamp: ``format`` and ``format_version``, the first two fields of the manifest and the
        resume header. Format 2 records each file's ``checksum`` (``"xxh3:…"``, see
        :mod:`graphsplit.caching.format.checksums`); format 1 (graphsplit 0.1) recorded its
        ``sha256`` (hex). Format-1 manifests and progress records are still read, their
        ``sha256`` taken as the checksum ``"sha256:…"``, so caches written before still open.
    unsynced: a manifest written by ``cache(..., durable=False)`` holds ``"unsynced":
        {"boot_id": ...}``, the boot of the machine that wrote it without fsyncs: its files
        are trusted only until that machine restarts (see
        :mod:`graphsplit.caching.store.durability`). A durable cache's manifest has no such field,
        so it is byte for byte what graphsplit wrote before the field existed; a graphsplit that
        predates it refuses an unsynced cache (an unexpected field) instead of reading it unchecked.

Each record is a frozen dataclass whose fields, in order, are its JSON fields (see
:mod:`graphsplit.caching.format.records`): the writers and the readers below share that one schema.
Reading is strict (exact fields, types, file names that cannot leave the folder, unique keys);
anything else raises :class:`ManifestError` naming the file and the field.

In and out::

    read_manifest(folder) -> Manifest                    write_manifest(folder, manifest)
    read_resume_header(folder) -> CacheHeader | None     write_resume_header(folder, header)
    read_shard_progress(folder, index, header) -> ShardProgress | None
    read_constants_progress(folder, header) -> ConstantsProgress | None
    write_progress(folder, progress)                     # either kind of progress record
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.format.checksums import CHECKSUM, CHECKSUM_MEANING
from graphsplit.caching.format.fingerprint import Fingerprint
from graphsplit.caching.format.memory_order import Order
from graphsplit.caching.format.records import (
    REBUILD,
    JsonReader,
    json_field,
    json_names,
    optional_names,
    to_json,
)
from graphsplit.caching.store.files import exists, real_folder, write_atomically
from graphsplit.errors import ManifestError, Remedy

__all__ = [
    "BOOT_ID",
    "CONSTANTS_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "PARTIAL_DIR",
    "CacheHeader",
    "ConstantsProgress",
    "ConstantsRecord",
    "FileRecord",
    "Manifest",
    "ShardLayout",
    "ShardProgress",
    "ShardRecord",
    "Unsynced",
    "has_resume_header",
    "read_constants_progress",
    "read_manifest",
    "read_resume_header",
    "read_shard_progress",
    "shard_file_name",
    "tensor_name",
    "write_manifest",
    "write_progress",
    "write_resume_header",
]

FORMAT = "graphsplit-cache"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: files recorded by "sha256" (see the module glossary)
MANIFEST_FILE = "manifest.json"
CONSTANTS_FILE = "constants.safetensors"
LOCK_FILE = ".lock"
PARTIAL_DIR = ".partial"
RESUME_HEADER_FILE = "header.json"
RESUME_HEADER_FILE_0_1 = "plan.json"  # graphsplit 0.1's name for it: read, never written
CONSTANTS_PROGRESS_FILE = "constants.json"
SHARD_FILE_PATTERN = re.compile(r"shard-(\d{5,9})\.safetensors")
SHARD_PROGRESS_PATTERN = re.compile(r"shard-(\d{5,9})\.json")
STORAGE_DTYPES = ("float16", "bfloat16")
BOOT_ID = re.compile(r"[0-9a-f-]{0,64}")  # Linux's is a UUID; empty: unknown
_SHA256 = {"pattern": re.compile(r"[0-9a-f]{64}"), "meaning": "64 lowercase hex digits"}


def shard_file_name(index: int) -> str:
    """``shard-00007.safetensors`` for shard 7."""
    return f"shard-{index:05d}.safetensors"


def shard_progress_name(index: int) -> str:
    """``shard-00007.json`` (in ``.partial/``) for shard 7."""
    return f"shard-{index:05d}.json"


def tensor_name(row: int, name: str) -> str:
    """The name of boundary tensor ``name`` of the shard's ``row``-th sample."""
    return f"{row}/{name}"


# ------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class ShardLayout:
    """How loader batches map to shards (see the module glossary)."""

    batches_per_shard: int = json_field(minimum=1)
    batch_size: int | None = json_field(minimum=1)
    shard_bytes: int = json_field(minimum=1)


@dataclass(frozen=True)
class CacheHeader:
    """What a caching run was started with; equal headers mean the same cache."""

    fingerprint: Fingerprint
    inputs: tuple[str, ...] = json_field(identifier=True)
    boundary: tuple[BoundarySpec, ...]
    storage_dtype: str | None = json_field(choices=STORAGE_DTYPES)
    layout: ShardLayout

    @property
    def sample_specs(self) -> tuple[BoundarySpec, ...]:
        """Boundary tensors stored per sample, in boundary order."""
        return tuple(spec for spec in self.boundary if not spec.is_constant)

    @property
    def constant_specs(self) -> tuple[BoundarySpec, ...]:
        """Boundary tensors stored once, in boundary order."""
        return tuple(spec for spec in self.boundary if spec.is_constant)

    def stored_dtype(self, spec: BoundarySpec) -> torch.dtype:
        """The dtype ``spec`` is stored in: the storage dtype for wider floating tensors."""
        if self.storage_dtype is None or not spec.dtype.is_floating_point:
            return spec.dtype
        storage = getattr(torch, self.storage_dtype)
        return storage if spec.dtype.itemsize > storage.itemsize else spec.dtype


@dataclass(frozen=True)
class FileRecord:
    """A finished file of the cache: its name, checksum and size in bytes."""

    file: str
    checksum: str = json_field(pattern=CHECKSUM, meaning=CHECKSUM_MEANING)
    bytes: int


@dataclass(frozen=True)
class ConstantsRecord(FileRecord):
    """The constants file; ``dim_orders`` maps each constant to its memory order."""

    dim_orders: Mapping[str, Order | None]


@dataclass(frozen=True)
class ShardRecord(FileRecord):
    """A finished shard as the manifest lists it: its file and its samples, in row order.

    ``shapes[row]`` lists the shape of each per-sample boundary tensor (header order);
    ``row_orders[row]`` their batch tensors' memory orders (None: plain contiguous);
    ``input_sha256[row]`` the sample's input digest.
    """

    keys: tuple[str, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]
    row_orders: tuple[tuple[Order | None, ...], ...] = json_field("dim_orders")
    input_sha256: tuple[str, ...] = json_field(**_SHA256)


@dataclass(frozen=True)
class Unsynced:
    """A cache written without fsyncs, in the boot ``boot_id`` (empty: the boot is unknown)."""

    boot_id: str = json_field(pattern=BOOT_ID, meaning="a boot id (lowercase hex and dashes)")


@dataclass(frozen=True)
class Manifest:
    """A complete cache: its header, when it was written (durably or not: ``unsynced``), its
    constants and shards."""

    created: str
    unsynced: Unsynced | None = json_field(optional=True)  # noqa: RUF009 (a dataclasses.field)
    header: CacheHeader = json_field(inline=True)  # noqa: RUF009 (a dataclasses.field)
    num_samples: int
    max_abs_error: Mapping[str, float]
    constants: ConstantsRecord | None
    shards: tuple[ShardRecord, ...]


@dataclass(frozen=True)
class ShardProgress:
    """``.partial/shard-*.json``: a finished shard's record, plus what resuming needs.

    ``positions`` are its samples' places in the loader, to check that a resumed run sees the
    same order; ``max_abs_error`` what storing it in a lower precision cost, per tensor.
    """

    shard: ShardRecord = json_field(inline=True)  # noqa: RUF009 (a dataclasses.field)
    positions: tuple[int, ...]
    max_abs_error: Mapping[str, float]


@dataclass(frozen=True)
class ConstantsProgress:
    """``.partial/constants.json``: the finished constants file and its storage errors."""

    constants: ConstantsRecord = json_field(inline=True)  # noqa: RUF009 (a dataclasses.field)
    max_abs_error: Mapping[str, float]


# ------------------------------------------------------------------------------------ writing


def write_manifest(folder: Path, manifest: Manifest, *, durable: bool = True) -> None:
    """Write ``manifest.json`` atomically (fsync'd unless ``durable=False``); one shard per
    line, so diffs and greps stay readable."""
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, **to_json(manifest)}
    data = (_format_json(document) + "\n").encode()
    write_atomically(folder / MANIFEST_FILE, data, durable=durable)


def write_resume_header(folder: Path, header: CacheHeader, *, durable: bool = True) -> None:
    """Record the header a run starts with, in ``.partial/header.json`` (fsync'd unless
    ``durable=False``: a header a power cut damaged is read as torn, and resuming then
    keeps only the shards that verify)."""
    real_folder(folder / PARTIAL_DIR, create=True, durable=durable)
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, **to_json(header)}
    data = json.dumps(document, indent=2).encode()
    write_atomically(folder / PARTIAL_DIR / RESUME_HEADER_FILE, data, durable=durable)


def write_progress(folder: Path, progress: ShardProgress | ConstantsProgress) -> None:
    """Record a finished shard or constants file in ``.partial/`` (after its file's rename).

    Durable like every file graphsplit writes; a lost or damaged one only means redoing
    that file.
    """
    if isinstance(progress, ShardProgress):
        name = Path(progress.shard.file).with_suffix(".json").name
    else:
        name = CONSTANTS_PROGRESS_FILE
    data = json.dumps(to_json(progress)).encode()
    real_folder(folder / PARTIAL_DIR, create=True)
    write_atomically(folder / PARTIAL_DIR / name, data)


def _format_json(value: Any, depth: int = 0, *, inline: bool = False) -> str:
    """Indented JSON whose lists of scalars, and each shard record, stay on one line."""
    pad, end = "  " * (depth + 1), "  " * depth
    if inline or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value)
    if isinstance(value, dict):
        items = (
            f"{pad}{json.dumps(key)}: {_format_json(item, depth + 1, inline=False)}"
            if key != "shards"
            else f"{pad}{json.dumps(key)}: "
            + "[\n"
            + ",\n".join(f"{pad}  {json.dumps(shard)}" for shard in item)
            + f"\n{pad}]"
            for key, item in value.items()
        )
        return "{\n" + ",\n".join(items) + f"\n{end}}}"
    if not any(isinstance(item, (dict, list)) for item in value):
        return json.dumps(value)
    return "[\n" + ",\n".join(pad + _format_json(item, depth + 1) for item in value) + f"\n{end}]"


# ------------------------------------------------------------------------------------ reading


def read_manifest(folder: Path) -> Manifest:
    """Read and strictly validate ``folder/manifest.json``.

    Raises:
        ManifestError: the folder holds no manifest, or it is malformed, of another format
            version, or names files outside the folder; the message names the field.
    """
    path = folder / MANIFEST_FILE
    if not exists(path):
        hint = ""
        if has_resume_header(folder):
            hint = (
                " (a caching run started there but did not finish; rerun graphsplit.cache with "
                "the same arguments to complete it)"
            )
        raise ManifestError(f"no graphsplit cache at {folder}: {MANIFEST_FILE} is missing{hint}")
    reader = JsonReader(path)
    manifest: Manifest = _read_stamped(reader, Manifest)
    header = manifest.header
    _check_header(reader, header)
    if manifest.constants is None and header.constant_specs:
        reader.fail("constants", "is null but the boundary has per-dataset constants")
    if manifest.constants is not None:
        _check_constants(reader, manifest.constants, header, "constants")
    for index, shard in enumerate(manifest.shards):
        _check_shard(reader, shard, header, index, f"shards[{index}]")
    _check_errors(reader, manifest.max_abs_error, header, "max_abs_error")
    counted = sum(len(shard.keys) for shard in manifest.shards)
    if manifest.num_samples != counted:
        reader.fail("num_samples", f"is {manifest.num_samples} but the shards list {counted}")
    _check_unique_keys(reader, manifest.shards)
    return manifest


def has_resume_header(folder: Path) -> bool:
    """Whether a caching run started in ``folder`` (and has not finished or been cleaned up)."""
    partial = folder / PARTIAL_DIR
    names = (RESUME_HEADER_FILE, RESUME_HEADER_FILE_0_1)
    return any(exists(partial / name) for name in names)


def read_resume_header(folder: Path) -> CacheHeader | None:
    """The header of an interrupted run in ``folder``, or None when there is none.

    Reads ``.partial/header.json``, or ``.partial/plan.json`` where graphsplit 0.1 left one.
    """
    for name in (RESUME_HEADER_FILE, RESUME_HEADER_FILE_0_1):
        path = folder / PARTIAL_DIR / name
        if exists(path):
            reader = JsonReader(path)
            header: CacheHeader = _read_stamped(reader, CacheHeader)
            _check_header(reader, header)
            return header
    return None


def read_shard_progress(folder: Path, index: int, header: CacheHeader) -> ShardProgress | None:
    """The progress record of shard ``index``, or None when absent or unreadable."""
    path = folder / PARTIAL_DIR / shard_progress_name(index)
    if not exists(path):
        return None
    reader = JsonReader(path)
    try:
        document = reader.load()
        _upgrade_file_record(document)
        progress: ShardProgress = reader.read(ShardProgress, document)
        _check_shard(reader, progress.shard, header, index, "")
        _check_errors(reader, progress.max_abs_error, header, "max_abs_error")
    except ManifestError:
        return None  # written atomically, so this is foreign or damaged: redo the shard
    return progress


def read_constants_progress(folder: Path, header: CacheHeader) -> ConstantsProgress | None:
    """The progress record of the constants file, or None when absent or unreadable."""
    path = folder / PARTIAL_DIR / CONSTANTS_PROGRESS_FILE
    if not exists(path):
        return None
    reader = JsonReader(path)
    try:
        document = reader.load()
        _upgrade_file_record(document)  # the constants record is inline
        progress: ConstantsProgress = reader.read(ConstantsProgress, document)
        _check_constants(reader, progress.constants, header, "constants")
        _check_errors(reader, progress.max_abs_error, header, "max_abs_error")
    except ManifestError:
        return None
    return progress


def _read_stamped(reader: JsonReader, cls: type) -> Any:
    """A document that opens with the stamp: check the stamp first, then read the rest."""
    document = reader.load()
    stamp = ("format", "format_version")
    reader.check_names(document, "", (*stamp, *json_names(cls)), optional=optional_names(cls))
    if document["format"] != FORMAT:
        reader.fail("format", f"is {document['format']!r}; expected {FORMAT!r}")
    version = document["format_version"]
    if type(version) is not int:
        reader.fail("format_version", f"is {version!r}; expected an integer")
    if version not in READABLE_VERSIONS:
        newer = version > FORMAT_VERSION
        raise ManifestError(
            f"{reader.path} has cache format version {version}, this graphsplit reads versions "
            f"{READABLE_VERSIONS[0]} to {FORMAT_VERSION}.\n  fix: "
            + ("upgrade graphsplit to read it, or " if newer else "")
            + REBUILD,
            remedy=Remedy.OVERWRITE,
        )
    if version == 1:
        _upgrade_file_record(document.get("constants"))
        shards = document.get("shards")
        for shard in shards if isinstance(shards, list) else ():
            _upgrade_file_record(shard)
    return reader.read(cls, {key: value for key, value in document.items() if key not in stamp})


def _upgrade_file_record(record: Any) -> None:
    """Turn a format-1 file record's ``"sha256": hex`` into ``"checksum": "sha256:hex"``, in
    place (anything else is left for the strict reader to judge)."""
    if isinstance(record, dict) and "sha256" in record and "checksum" not in record:
        value = record.pop("sha256")
        record["checksum"] = f"sha256:{value}" if isinstance(value, str) else value


# ---------------------------------------------------- rules that span fields (after the types)


def _check_header(reader: JsonReader, header: CacheHeader) -> None:
    for index, spec in enumerate(header.boundary):
        where = f"boundary[{index}]"
        if not spec.name.isidentifier():
            reader.fail(f"{where}.name", f"is {spec.name!r}; expected a Python identifier")
        if spec.batch_dim is not None and spec.batch_dim >= len(spec.shape):
            reader.fail(
                f"{where}.batch_dim",
                f"is {spec.batch_dim!r}; expected null or a dim of {spec.shape}",
            )
    names = [spec.name for spec in header.boundary]
    if len(set(names)) != len(names):
        reader.fail("boundary", f"repeats a name: {names}")


def _check_constants(
    reader: JsonReader, record: ConstantsRecord, header: CacheHeader, where: str
) -> None:
    if record.file != CONSTANTS_FILE:
        reader.fail(f"{where}.file", f"is {record.file!r}; expected {CONSTANTS_FILE!r}")
    specs = {spec.name: spec for spec in header.constant_specs}
    if set(record.dim_orders) != set(specs):
        reader.fail(
            f"{where}.dim_orders", f"names {sorted(record.dim_orders)}, not {sorted(specs)}"
        )
    for name, order in record.dim_orders.items():
        _check_order(reader, order, f"{where}.dim_orders.{name}", len(specs[name].shape))


def _check_shard(
    reader: JsonReader, record: ShardRecord, header: CacheHeader, index: int, where: str
) -> None:
    if record.file != shard_file_name(index):
        reader.fail(
            _join(where, "file"),
            f"is {record.file!r}; shard {index} must be {shard_file_name(index)!r} "
            "(a file name inside the cache folder)",
        )
    specs = header.sample_specs
    for row, (shapes, orders) in enumerate(zip(record.shapes, record.row_orders)):
        shapes_at, orders_at = _join(where, f"shapes[{row}]"), _join(where, f"dim_orders[{row}]")
        tensors = f"{len(specs)} per-sample tensors"
        if len(shapes) != len(specs):
            reader.fail(shapes_at, f"lists {len(shapes)} shapes for {tensors}")
        if len(orders) != len(specs):
            reader.fail(orders_at, f"lists {len(orders)} orders for {tensors}")
        for column, (shape, order, spec) in enumerate(zip(shapes, orders, specs)):
            if len(shape) != len(spec.shape) - 1:
                reader.fail(
                    f"{shapes_at}[{column}]",
                    f"has {len(shape)} dims; a row of {spec.name!r} has {len(spec.shape) - 1}",
                )
            _check_order(reader, order, f"{orders_at}[{column}]", len(spec.shape))
    counts = {len(record.keys), len(record.shapes), len(record.row_orders)}
    if len(counts | {len(record.input_sha256)}) > 1:
        reader.fail(
            where or "shard record", "lists different numbers of keys, shapes, orders and digests"
        )


def _check_order(reader: JsonReader, order: Order | None, where: str, ndim: int) -> None:
    if order is not None and sorted(order) != list(range(ndim)):
        reader.fail(where, f"is {list(order)}, not an order of {ndim} dims")


def _check_errors(
    reader: JsonReader, errors: Mapping[str, float], header: CacheHeader, where: str
) -> None:
    names = {spec.name for spec in header.boundary}
    for name in errors:
        if name not in names:
            reader.fail(where, f"names {name!r}, which is not a boundary tensor")


def _check_unique_keys(reader: JsonReader, shards: Iterable[ShardRecord]) -> None:
    seen: dict[str, int] = {}
    for index, shard in enumerate(shards):
        for key in shard.keys:
            if key in seen:
                reader.fail(
                    "shards", f"list the sample key {key!r} twice (shards {seen[key]}, {index})"
                )
            seen[key] = index


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
