"""The on-disk format of a cache folder, described once: file names, records, and their rules.

A cache folder holds::

    manifest.json              Manifest, written last, atomically: the cache is complete iff
                               it exists
    constants.safetensors      per-dataset constants (boundary tensors without a batch dim)
    constants-3f0c….safetensors  a plan's own constants, in a cache of several plans whose
                               constants differ (Manifest.plans[key].constants)
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
    paired rows: a cache of a split whose stage 2 pairs its batch's rows by position
        (``split.paired_rows``, a :class:`~graphsplit.artifacts.PairedRows`) records it in its
        header, and each shard records ``batch_rows``, the row count of each stage-1 batch it
        holds, so the reader can give stage 2 those batches whole
        (:mod:`graphsplit.caching.read.whole_batches`). An ordinary cache has neither field; a
        graphsplit that predates them refuses a paired cache (an unexpected field) instead of
        regrouping its rows.

Each record is a frozen dataclass whose fields, in order, are its JSON fields (see
:mod:`graphsplit.caching.format.records`): the writers and the readers share that one schema.
Reading is strict (exact fields, types, file names that cannot leave the folder, unique keys;
:mod:`graphsplit.caching.format.record_documents`); anything else raises
:class:`ManifestError` naming the file and the field. This module only describes: the records'
files are read and written by :mod:`graphsplit.caching.store.record_files`.

In and out::

    shard_file_name(index) -> "shard-00007.safetensors"
    shard_progress_name(index) -> "shard-00007.json"
    tensor_name(row, name) -> "3/latents"
    CacheHeader, ShardLayout, Manifest, FileRecord, ConstantsRecord, ShardRecord, Unsynced,
    ShardProgress, ConstantsProgress                     # the records
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from graphsplit.artifacts import BoundarySpec, PairedRows
from graphsplit.caching.format.checksums import CHECKSUM, CHECKSUM_MEANING
from graphsplit.caching.format.fingerprint import Fingerprint
from graphsplit.caching.format.memory_order import Order
from graphsplit.caching.format.records import json_field

__all__ = [
    "BOOT_ID",
    "CONSTANTS_FILE",
    "CONSTANTS_PROGRESS_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "PARTIAL_DIR",
    "PLAN_CONSTANTS_PATTERN",
    "READABLE_VERSIONS",
    "RESUME_HEADER_FILE",
    "RESUME_HEADER_FILE_0_1",
    "CacheHeader",
    "ConstantsProgress",
    "ConstantsRecord",
    "FileRecord",
    "Manifest",
    "PlanRecord",
    "ShardLayout",
    "ShardProgress",
    "ShardRecord",
    "Unsynced",
    "constants_records",
    "plan_constants_file",
    "shard_file_name",
    "shard_progress_name",
    "tensor_name",
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
PLAN_CONSTANTS_PATTERN = re.compile(r"constants-[0-9a-f]{16}\.safetensors")
SHARD_PROGRESS_PATTERN = re.compile(r"shard-(\d{5,9})\.json")
STORAGE_DTYPES = ("float16", "bfloat16")
BOOT_ID = re.compile(r"[0-9a-f-]{0,64}")  # Linux's is a UUID; empty: unknown
_ETAG = re.compile(r"[\x21-\x7e]{1,256}")  # an S3 ETag is a quoted hex digest, "…-N" if multipart
_ETAG_MEANING = "an object version (1 to 256 printable ASCII characters)"
_SHA256 = {"pattern": re.compile(r"[0-9a-f]{64}"), "meaning": "64 lowercase hex digits"}


def shard_file_name(index: int) -> str:
    """``shard-00007.safetensors`` for shard 7."""
    return f"shard-{index:05d}.safetensors"


def shard_progress_name(index: int) -> str:
    """``shard-00007.json`` (in ``.partial/``) for shard 7."""
    return f"shard-{index:05d}.json"


def plan_constants_file(key: str) -> str:
    """``constants-3f0c9a1e27b4d655.safetensors``: the constants of plan ``key`` (a signature
    key, see :mod:`graphsplit.signatures.signature`)."""
    return f"constants-{key}.safetensors"


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
    # Where stage 2 pairs its batch's rows by position (see the module glossary): absent in an
    # ordinary cache, which stays byte for byte what graphsplit wrote before the field existed.
    paired_rows: PairedRows | None = json_field(optional=True, default=None)  # noqa: RUF009

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
    """A finished file of the cache: its name, checksum and size in bytes; on an object store
    also its ``etag``, the version the store gave it when it was written (readers refuse
    another version: see :mod:`graphsplit.caching.store.pinned_object`). Optional: a local
    cache's records, and those written before the field existed, have none."""

    file: str
    checksum: str = json_field(pattern=CHECKSUM, meaning=CHECKSUM_MEANING)
    bytes: int
    etag: str | None = json_field(
        optional=True, default=None, kw_only=True, pattern=_ETAG, meaning=_ETAG_MEANING
    )


@dataclass(frozen=True)
class ConstantsRecord(FileRecord):
    """The constants file; ``dim_orders`` maps each constant to its memory order."""

    dim_orders: Mapping[str, Order | None]


@dataclass(frozen=True)
class PlanRecord:
    """One plan of a cache of several shape signatures (see :mod:`graphsplit.signatures`):
    its ``signature`` (canonical JSON), the ``example`` it was made from (JSON of shapes and
    dtypes, empty when JSON cannot hold it) and its stage 1's ``code`` digest (plans whose
    stage 1 is the same code share it)."""

    signature: str
    example: str
    code: str
    # The plan's own per-dataset constants, when they are not the manifest's ``constants``
    # (those are the constants of the plan of loader batch 0). Absent in caches written before
    # constants were kept per plan, and for the plan of batch 0.
    constants: ConstantsRecord | None = json_field(optional=True, default=None)  # noqa: RUF009


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
    # Each row's plan (signature key), only in a shard holding a row of a plan other than the
    # first: absent, every row is the first plan's (a cache of one plan stays as it was).
    signatures: tuple[str, ...] | None = json_field(optional=True, default=None)
    # How many rows each stage-1 batch put in the shard, in order; only in a cache whose
    # header has ``paired_rows`` (see the module glossary).
    batch_rows: tuple[int, ...] | None = json_field(optional=True, default=None, minimum=1)


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
    # The plans by signature key, the first plan's first; only in a cache of several plans.
    plans: Mapping[str, PlanRecord] | None = json_field(optional=True, default=None)
    first_plan: str | None = json_field(optional=True, default=None)


def constants_records(manifest: Manifest) -> list[ConstantsRecord]:
    """Every constants file a manifest records: the cache's, then each plan's own."""
    records = [] if manifest.constants is None else [manifest.constants]
    for plan in (manifest.plans or {}).values():
        if plan.constants is not None:
            records.append(plan.constants)
    return records


@dataclass(frozen=True)
class ShardProgress:
    """``.partial/shard-*.json``: a finished shard's record, plus what resuming needs.

    ``positions`` are its samples' places in the loader, to check that a resumed run sees the
    same order; ``max_abs_error`` what storing it in a lower precision cost, per tensor.
    """

    shard: ShardRecord = json_field(inline=True)  # noqa: RUF009 (a dataclasses.field)
    positions: tuple[int, ...]
    max_abs_error: Mapping[str, float]
    plans: Mapping[str, PlanRecord] | None = json_field(optional=True, default=None)


@dataclass(frozen=True)
class ConstantsProgress:
    """``.partial/constants.json``: the finished constants file and its storage errors."""

    constants: ConstantsRecord = json_field(inline=True)  # noqa: RUF009 (a dataclasses.field)
    max_abs_error: Mapping[str, float]
