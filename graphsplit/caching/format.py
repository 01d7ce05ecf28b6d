"""The on-disk format of a cache folder: file names, the manifest, resume records, checksums.

A cache folder holds::

    manifest.json            written last, atomically: the cache is complete iff it exists
    constants.safetensors    per-dataset constants (boundary tensors without a batch dim), once
    shard-00000.safetensors  per-sample rows, tensor names "{row}/{boundary name}"
    .partial/plan.json       while writing: the header the run was started with (for resume)
    .partial/shard-00000.json  while writing: the record of each finished shard (for resume)
    .lock                    while writing: pid and host of the writer

Glossary:
    header: what a run was started with (fingerprint, inputs, boundary, storage, layout); the
        plan file and the manifest both hold it, so a resumed run can check it continues the
        same cache.
    shard record: one shard's file name, sha256, size and its samples (keys, per-tensor shapes,
        input digests) in row order; the manifest lists them in shard order, so sample ``i`` of
        the cache is the ``i``-th row counted across shards.
    layout: shard ``k`` holds the rows of loader batches ``k * batches_per_shard`` up to the next
        multiple, which makes the layout a pure function of the loader's order and lets resumed
        and multi-process runs write the same files as one uninterrupted process.
    memory order: a boundary tensor's dims from outermost to innermost in memory, recorded when
        it is not plain contiguous (a channels-last VAE output, a transposed embedding). Rows are
        stored in memory order and read back with the same strides, because stage 2 must see
        the layout stage 1 produced: ``randn_like`` fills memory in that order, and kernels pick
        their algorithm by it.

Every JSON file is validated strictly on read (exact fields, types, file names that cannot
leave the folder, unique keys); anything else raises :class:`ManifestError` naming the field.

In and out::

    read_manifest(folder) -> Manifest            write_manifest(folder, manifest)
    read_plan(folder) -> CacheHeader | None      write_plan(folder, header)
    read_shard_record(folder, index) -> ShardRecord | None      write_shard_record(folder, r)
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.fingerprint import Fingerprint
from graphsplit.errors import ManifestError

__all__ = [
    "CONSTANTS_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "PARTIAL_DIR",
    "CacheHeader",
    "FileRecord",
    "Layout",
    "Manifest",
    "ShardRecord",
    "read_constants_record",
    "read_manifest",
    "read_plan",
    "read_shard_record",
    "sha256_file",
    "shard_file_name",
    "tensor_name",
    "write_atomically",
    "write_constants_record",
    "write_manifest",
    "write_plan",
    "write_shard_record",
]

FORMAT = "graphsplit-cache"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
CONSTANTS_FILE = "constants.safetensors"
PARTIAL_DIR = ".partial"
PLAN_FILE = "plan.json"
LOCK_FILE = ".lock"
SHARD_FILE_PATTERN = re.compile(r"shard-(\d{5,9})\.safetensors")
STORAGE_DTYPES = ("float16", "bfloat16")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_REBUILD = "rebuild the cache with graphsplit.cache(split, loader, path, overwrite=True)"


def shard_file_name(index: int) -> str:
    """``shard-00007.safetensors`` for shard 7."""
    return f"shard-{index:05d}.safetensors"


def tensor_name(row: int, name: str) -> str:
    """The name of boundary tensor ``name`` of the shard's ``row``-th sample."""
    return f"{row}/{name}"


@dataclass(frozen=True)
class Layout:
    """How loader batches map to shards (see the module glossary)."""

    batches_per_shard: int
    batch_size: int | None
    shard_bytes: int


@dataclass(frozen=True)
class CacheHeader:
    """What a caching run was started with; equal headers mean the same cache."""

    fingerprint: Fingerprint
    inputs: tuple[str, ...]
    boundary: tuple[BoundarySpec, ...]
    storage_dtype: str | None
    layout: Layout

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


Order = tuple[int, ...]  # a memory order (see the glossary); None where plain contiguous


def memory_order(tensor: torch.Tensor) -> Order | None:
    """``tensor``'s dims from outermost to innermost in memory; None if plain contiguous.

    Also None for tensors that are not dense (expanded or strided views): torch lays out what
    it derives from those contiguously too. Size-1 dims, whose strides mean nothing, go before
    the first larger dim that follows them, so a batch of one has the order of a full batch.
    """
    if tensor.is_contiguous():
        return None
    sized = sorted(
        (d for d in range(tensor.dim()) if tensor.shape[d] != 1),
        key=lambda d: (-tensor.stride(d), d),
    )
    expected = 1
    for d in reversed(sized):
        if tensor.stride(d) != expected:
            return None
        expected *= tensor.shape[d]
    ones = [d for d in range(tensor.dim()) if tensor.shape[d] == 1]
    order: list[int] = []
    for d in sized:
        order += [one for one in ones if one < d and one not in order]
        order.append(d)
    order += [one for one in ones if one not in order]
    return None if order == sorted(order) else tuple(order)


def row_order(order: Order, batch_dim: int) -> Order:
    """The memory order of one row: ``order`` without the batch dim, renumbered."""
    return tuple(d - (d > batch_dim) for d in order if d != batch_dim)


def inverse(order: Order) -> Order:
    """The permutation that undoes ``tensor.permute(order)``."""
    result = [0] * len(order)
    for position, d in enumerate(order):
        result[d] = position
    return tuple(result)


@dataclass(frozen=True)
class FileRecord:
    """A finished file of the cache: its name, sha256 and size in bytes.

    For the constants file, ``dim_orders`` maps each constant to its memory order.
    """

    file: str
    sha256: str
    bytes: int
    max_abs_error: Mapping[str, float] = field(default_factory=dict)
    dim_orders: Mapping[str, Order | None] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardRecord(FileRecord):
    """A finished shard: its file and its samples, in row order.

    ``shapes[row]`` lists the shape of each per-sample boundary tensor (header order);
    ``row_orders[row]`` their batch tensors' memory orders (None: plain contiguous);
    ``positions`` (resume records only) are the samples' positions in the loader, to check that
    a resumed run sees the same order.
    """

    keys: tuple[str, ...] = ()
    shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()
    row_orders: tuple[tuple[Order | None, ...], ...] = ()
    input_sha256: tuple[str, ...] = ()
    positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """A complete cache: its header, when it was written, its constants and shards."""

    header: CacheHeader
    created: str
    constants: FileRecord | None
    shards: tuple[ShardRecord, ...]
    max_abs_error: Mapping[str, float]

    @property
    def num_samples(self) -> int:
        return sum(len(shard.keys) for shard in self.shards)


# ---------------------------------------------------------------------------------- writing


def write_atomically(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The bytes go to a temporary name in the same folder and are renamed over ``path``. When
    ``durable``, the file is fsync'd before and the folder after the rename, so both survive a
    power loss; resume records skip that, as a lost or damaged one only means redoing a shard.
    """
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(temporary, path)
    if durable:
        fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make renames inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, hashed from a read-only memory map (no copy)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return hashlib.sha256().hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically; one shard per line, so diffs and greps stay readable."""
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": manifest.created,
        **_header_to_json(manifest.header),
        "num_samples": manifest.num_samples,
        "max_abs_error": dict(manifest.max_abs_error),
        "constants": None if manifest.constants is None else _constants_to_json(manifest.constants),
        "shards": [_shard_to_json(shard, resume=False) for shard in manifest.shards],
    }
    write_atomically(folder / MANIFEST_FILE, (_format_json(document) + "\n").encode())


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


def write_plan(folder: Path, header: CacheHeader) -> None:
    """Record the header a run starts with, in ``.partial/plan.json``."""
    (folder / PARTIAL_DIR).mkdir(exist_ok=True)
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, **_header_to_json(header)}
    data = json.dumps(document, indent=2).encode()
    write_atomically(folder / PARTIAL_DIR / PLAN_FILE, data, durable=False)


def write_shard_record(folder: Path, record: ShardRecord) -> None:
    """Record a finished shard in ``.partial/`` (after its file was renamed into place)."""
    name = Path(record.file).with_suffix(".json").name
    data = json.dumps(_shard_to_json(record, resume=True)).encode()
    write_atomically(folder / PARTIAL_DIR / name, data, durable=False)


def write_constants_record(folder: Path, record: FileRecord) -> None:
    """Record the finished constants file in ``.partial/constants.json``."""
    document = {**_constants_to_json(record), "max_abs_error": dict(record.max_abs_error)}
    data = json.dumps(document).encode()
    write_atomically(folder / PARTIAL_DIR / "constants.json", data, durable=False)


def _header_to_json(header: CacheHeader) -> dict[str, Any]:
    return {
        "fingerprint": header.fingerprint.to_json(),
        "inputs": list(header.inputs),
        "boundary": [spec.to_json() for spec in header.boundary],
        "storage_dtype": header.storage_dtype,
        "layout": {
            "batches_per_shard": header.layout.batches_per_shard,
            "batch_size": header.layout.batch_size,
            "shard_bytes": header.layout.shard_bytes,
        },
    }


def _file_to_json(record: FileRecord) -> dict[str, Any]:
    return {"file": record.file, "sha256": record.sha256, "bytes": record.bytes}


def _constants_to_json(record: FileRecord) -> dict[str, Any]:
    orders = {name: _order_to_json(order) for name, order in record.dim_orders.items()}
    return {**_file_to_json(record), "dim_orders": orders}


def _order_to_json(order: Order | None) -> list[int] | None:
    return None if order is None else list(order)


def _shard_to_json(record: ShardRecord, *, resume: bool) -> dict[str, Any]:
    document = {
        **_file_to_json(record),
        "keys": list(record.keys),
        "shapes": [[list(shape) for shape in row] for row in record.shapes],
        "dim_orders": [[_order_to_json(order) for order in row] for row in record.row_orders],
        "input_sha256": list(record.input_sha256),
    }
    if resume:
        document["positions"] = list(record.positions)
        document["max_abs_error"] = dict(record.max_abs_error)
    return document


# ---------------------------------------------------------------------------------- reading


def read_manifest(folder: Path) -> Manifest:
    """Read and strictly validate ``folder/manifest.json``.

    Raises:
        ManifestError: the folder holds no manifest, or it is malformed, of another format
            version, or names files outside the folder; the message names the field.
    """
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(
            f"no graphsplit cache at {folder}: {MANIFEST_FILE} is missing"
            + _partial_hint(Path(folder))
        )
    check = _Checker(path)
    document = check.load()
    check.fields(
        document,
        "",
        required=(
            "format",
            "format_version",
            "created",
            "fingerprint",
            "inputs",
            "boundary",
            "storage_dtype",
            "layout",
            "num_samples",
            "max_abs_error",
            "constants",
            "shards",
        ),
    )
    check.format(document)
    header = _read_header(check, document)
    constants = _read_constants(check, document["constants"], header)
    shards = tuple(
        _read_shard(check, item, f"shards[{index}]", header, index, resume=False)
        for index, item in enumerate(check.sequence(document["shards"], "shards"))
    )
    manifest = Manifest(
        header=header,
        created=check.string(document["created"], "created"),
        constants=constants,
        shards=shards,
        max_abs_error=check.errors(document["max_abs_error"], "max_abs_error", header),
    )
    num_samples = check.integer(document["num_samples"], "num_samples")
    if num_samples != manifest.num_samples:
        check.fail("num_samples", f"is {num_samples} but the shards list {manifest.num_samples}")
    _check_unique_keys(check, shards)
    return manifest


def read_plan(folder: Path) -> CacheHeader | None:
    """The header of an interrupted run in ``folder``, or None when there is none."""
    path = Path(folder) / PARTIAL_DIR / PLAN_FILE
    if not path.is_file():
        return None
    check = _Checker(path)
    document = check.load()
    check.fields(
        document,
        "",
        required=(
            "format",
            "format_version",
            "fingerprint",
            "inputs",
            "boundary",
            "storage_dtype",
            "layout",
        ),
    )
    check.format(document)
    return _read_header(check, document)


def read_shard_record(folder: Path, index: int, header: CacheHeader) -> ShardRecord | None:
    """The resume record of shard ``index``, or None when absent or unreadable."""
    path = Path(folder) / PARTIAL_DIR / f"shard-{index:05d}.json"
    if not path.is_file():
        return None
    check = _Checker(path)
    try:
        return _read_shard(check, check.load(), "", header, index, resume=True)
    except ManifestError:
        return None  # written atomically, so this is foreign or damaged: redo the shard


def read_constants_record(folder: Path, header: CacheHeader) -> FileRecord | None:
    """The resume record of the constants file, or None when absent or unreadable."""
    path = Path(folder) / PARTIAL_DIR / "constants.json"
    if not path.is_file():
        return None
    check = _Checker(path)
    try:
        document = check.load()
        check.fields(
            document, "", required=("file", "sha256", "bytes", "dim_orders", "max_abs_error")
        )
        record = _read_constants(check, document, header, extra=("max_abs_error",))
        if record is None:
            return None
        errors = check.errors(document["max_abs_error"], "max_abs_error", header)
        return replace(record, max_abs_error=errors)
    except ManifestError:
        return None


def _partial_hint(folder: Path) -> str:
    if (folder / PARTIAL_DIR / PLAN_FILE).is_file():
        return (
            " (a caching run started there but did not finish; rerun graphsplit.cache with the "
            "same arguments to complete it)"
        )
    return ""


def _read_header(check: _Checker, document: dict[str, Any]) -> CacheHeader:
    fingerprint = _read_fingerprint(check, document["fingerprint"])
    inputs = tuple(
        check.identifier(name, f"inputs[{index}]")
        for index, name in enumerate(check.sequence(document["inputs"], "inputs"))
    )
    boundary = tuple(
        _read_spec(check, item, f"boundary[{index}]")
        for index, item in enumerate(check.sequence(document["boundary"], "boundary"))
    )
    names = [spec.name for spec in boundary]
    if len(set(names)) != len(names):
        check.fail("boundary", f"repeats a name: {names}")
    storage = document["storage_dtype"]
    if storage is not None and storage not in STORAGE_DTYPES:
        check.fail("storage_dtype", f"is {storage!r}; expected null or one of {STORAGE_DTYPES}")
    layout = check.mapping(document["layout"], "layout")
    check.fields(layout, "layout", required=("batches_per_shard", "batch_size", "shard_bytes"))
    batch_size = layout["batch_size"]
    return CacheHeader(
        fingerprint=fingerprint,
        inputs=inputs,
        boundary=boundary,
        storage_dtype=storage,
        layout=Layout(
            batches_per_shard=check.integer(
                layout["batches_per_shard"], "layout.batches_per_shard", minimum=1
            ),
            batch_size=None
            if batch_size is None
            else check.integer(batch_size, "layout.batch_size", minimum=1),
            shard_bytes=check.integer(layout["shard_bytes"], "layout.shard_bytes", minimum=1),
        ),
    )


def _read_fingerprint(check: _Checker, value: Any) -> Fingerprint:
    document = check.mapping(value, "fingerprint")
    check.fields(document, "fingerprint", required=("code", "weights", "boundary", "versions"))
    digests = {}
    for part in ("code", "weights", "boundary"):
        digest = check.string(document[part], f"fingerprint.{part}")
        if not _DIGEST.fullmatch(digest):
            check.fail(f"fingerprint.{part}", f"is {digest!r}, not 'sha256:' + 64 hex digits")
        digests[part] = digest
    versions = {
        check.string(name, "fingerprint.versions"): check.string(
            version, f"fingerprint.versions.{name}"
        )
        for name, version in check.mapping(document["versions"], "fingerprint.versions").items()
    }
    return Fingerprint(versions=versions, **digests)


def _read_spec(check: _Checker, value: Any, where: str) -> BoundarySpec:
    document = check.mapping(value, where)
    check.fields(
        document,
        where,
        required=("name", "shape", "dtype", "batch_dim", "bytes_per_sample", "source"),
    )
    check.identifier(document["name"], f"{where}.name")
    shape = check.shape(document["shape"], f"{where}.shape")
    check.string(document["dtype"], f"{where}.dtype")
    check.string(document["source"], f"{where}.source")
    check.integer(document["bytes_per_sample"], f"{where}.bytes_per_sample")
    batch_dim = document["batch_dim"]
    if batch_dim is not None and not (
        type(batch_dim) is int and 0 <= batch_dim < max(len(shape), 1) and shape
    ):
        check.fail(f"{where}.batch_dim", f"is {batch_dim!r}; expected null or a dim of {shape}")
    try:
        return BoundarySpec.from_json(document)
    except ValueError as error:
        check.fail(where, str(error))


def _read_file(check: _Checker, value: Any, where: str) -> FileRecord:
    document = check.mapping(value, where or "file record")
    sha = check.string(document.get("sha256"), _join(where, "sha256"))
    if not _SHA256.fullmatch(sha):
        check.fail(_join(where, "sha256"), f"is {sha!r}, not 64 lowercase hex digits")
    return FileRecord(
        file=check.string(document.get("file"), _join(where, "file")),
        sha256=sha,
        bytes=check.integer(document.get("bytes"), _join(where, "bytes")),
    )


def _read_constants(
    check: _Checker, value: Any, header: CacheHeader, *, extra: Sequence[str] = ()
) -> FileRecord | None:
    if value is None:
        if header.constant_specs:
            check.fail("constants", "is null but the boundary has per-dataset constants")
        return None
    document = check.mapping(value, "constants")
    check.fields(document, "constants", required=("file", "sha256", "bytes", "dim_orders", *extra))
    record = _read_file(check, document, "constants")
    if record.file != CONSTANTS_FILE:
        check.fail("constants.file", f"is {record.file!r}; expected {CONSTANTS_FILE!r}")
    orders = check.mapping(document["dim_orders"], "constants.dim_orders")
    specs = {spec.name: spec for spec in header.constant_specs}
    if set(orders) != set(specs):
        check.fail("constants.dim_orders", f"names {sorted(orders)}, not {sorted(specs)}")
    dim_orders = {
        name: check.order(order, f"constants.dim_orders.{name}", len(specs[name].shape))
        for name, order in orders.items()
    }
    return replace(record, dim_orders=dim_orders)


def _read_shard(
    check: _Checker, value: Any, where: str, header: CacheHeader, index: int, *, resume: bool
) -> ShardRecord:
    document = check.mapping(value, where or "shard record")
    required = ["file", "sha256", "bytes", "keys", "shapes", "dim_orders", "input_sha256"]
    if resume:
        required += ["positions", "max_abs_error"]
    check.fields(document, where, required=tuple(required))
    record = _read_file(check, document, where)
    if record.file != shard_file_name(index):
        check.fail(
            _join(where, "file"),
            f"is {record.file!r}; shard {index} must be {shard_file_name(index)!r} "
            "(a file name inside the cache folder)",
        )
    keys = tuple(
        check.string(key, _join(where, f"keys[{row}]"))
        for row, key in enumerate(check.sequence(document["keys"], _join(where, "keys")))
    )
    specs = header.sample_specs
    shapes = []
    for row, item in enumerate(check.sequence(document["shapes"], _join(where, "shapes"))):
        at = _join(where, f"shapes[{row}]")
        per_tensor = check.sequence(item, at)
        if len(per_tensor) != len(specs):
            check.fail(at, f"lists {len(per_tensor)} shapes for {len(specs)} per-sample tensors")
        shapes.append(
            tuple(
                _read_row_shape(check, shape, f"{at}[{column}]", spec)
                for column, (shape, spec) in enumerate(zip(per_tensor, specs))
            )
        )
    orders = []
    for row, item in enumerate(check.sequence(document["dim_orders"], _join(where, "dim_orders"))):
        at = _join(where, f"dim_orders[{row}]")
        per_tensor = check.sequence(item, at)
        if len(per_tensor) != len(specs):
            check.fail(at, f"lists {len(per_tensor)} orders for {len(specs)} per-sample tensors")
        orders.append(
            tuple(
                check.order(order, f"{at}[{column}]", len(spec.shape))
                for column, (order, spec) in enumerate(zip(per_tensor, specs))
            )
        )
    digests = tuple(
        check.string(digest, _join(where, f"input_sha256[{row}]"))
        for row, digest in enumerate(
            check.sequence(document["input_sha256"], _join(where, "input_sha256"))
        )
    )
    for row, digest in enumerate(digests):
        if not _SHA256.fullmatch(digest):
            check.fail(_join(where, f"input_sha256[{row}]"), "is not 64 lowercase hex digits")
    if not (len(keys) == len(shapes) == len(orders) == len(digests)):
        check.fail(
            where or "shard record", "lists different numbers of keys, shapes, orders and digests"
        )
    positions: tuple[int, ...] = ()
    errors: dict[str, float] = {}
    if resume:
        positions = tuple(
            check.integer(position, f"positions[{row}]")
            for row, position in enumerate(check.sequence(document["positions"], "positions"))
        )
        errors = check.errors(document["max_abs_error"], "max_abs_error", header)
    return ShardRecord(
        file=record.file,
        sha256=record.sha256,
        bytes=record.bytes,
        max_abs_error=errors,
        keys=keys,
        shapes=tuple(shapes),
        row_orders=tuple(orders),
        input_sha256=digests,
        positions=positions,
    )


def _read_row_shape(check: _Checker, value: Any, where: str, spec: BoundarySpec) -> tuple[int, ...]:
    shape = check.shape(value, where)
    if len(shape) != len(spec.shape) - 1:
        check.fail(
            where, f"has {len(shape)} dims; a row of {spec.name!r} has {len(spec.shape) - 1}"
        )
    return shape


def _check_unique_keys(check: _Checker, shards: Sequence[ShardRecord]) -> None:
    seen: dict[str, int] = {}
    for index, shard in enumerate(shards):
        for key in shard.keys:
            if key in seen:
                check.fail(
                    "shards", f"list the sample key {key!r} twice (shards {seen[key]}, {index})"
                )
            seen[key] = index


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


class _Checker:
    """Type checks that raise a :class:`ManifestError` naming the file and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> NoReturn:
        raise ManifestError(
            f"{self.path} is not a valid graphsplit cache file: {where or 'the document'} "
            f"{problem}.\n  fix: the file is damaged or was not written by graphsplit; {_REBUILD}"
        )

    def load(self) -> dict[str, Any]:
        try:
            text = self.path.read_bytes().decode("utf-8")
            document = json.loads(
                text, object_pairs_hook=_unique_object, parse_constant=_reject_constant
            )
        except (UnicodeDecodeError, ValueError) as error:
            raise ManifestError(
                f"{self.path} is not valid JSON ({error}).\n  fix: the file is damaged or was "
                f"not written by graphsplit; {_REBUILD}"
            ) from None
        return self.mapping(document, "")

    def format(self, document: Mapping[str, Any]) -> None:
        if document["format"] != FORMAT:
            self.fail("format", f"is {document['format']!r}; expected {FORMAT!r}")
        version = document["format_version"]
        if type(version) is not int:
            self.fail("format_version", f"is {version!r}; expected an integer")
        if version != FORMAT_VERSION:
            newer = version > FORMAT_VERSION
            raise ManifestError(
                f"{self.path} has cache format version {version}, this graphsplit reads version "
                f"{FORMAT_VERSION}.\n  fix: "
                + ("upgrade graphsplit to read it, or " if newer else "")
                + _REBUILD
            )

    def fields(self, document: Mapping[str, Any], where: str, *, required: Sequence[str]) -> None:
        missing = [name for name in required if name not in document]
        if missing:
            self.fail(where, f"lacks the field(s) {missing}")
        extra = sorted(set(document) - set(required))
        if extra:
            self.fail(where, f"has unexpected field(s) {extra}")

    def mapping(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"is {_kind(value)}; expected an object")
        return value

    def sequence(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(where, f"is {_kind(value)}; expected a list")
        return value

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            self.fail(where, f"is {_kind(value)}; expected a string")
        return value

    def identifier(self, value: Any, where: str) -> str:
        if not self.string(value, where).isidentifier():
            self.fail(where, f"is {value!r}; expected a Python identifier")
        return value

    def integer(self, value: Any, where: str, *, minimum: int = 0) -> int:
        if type(value) is not int or value < minimum:
            self.fail(where, f"is {_kind(value)}; expected an integer >= {minimum}")
        return value

    def number(self, value: Any, where: str) -> float:
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            self.fail(where, f"is {_kind(value)}; expected a finite number >= 0")
        return float(value)

    def shape(self, value: Any, where: str) -> tuple[int, ...]:
        return tuple(
            self.integer(size, f"{where}[{dim}]")
            for dim, size in enumerate(self.sequence(value, where))
        )

    def order(self, value: Any, where: str, ndim: int) -> Order | None:
        if value is None:
            return None
        order = tuple(
            self.integer(d, f"{where}[{i}]") for i, d in enumerate(self.sequence(value, where))
        )
        if sorted(order) != list(range(ndim)):
            self.fail(where, f"is {list(order)}, not an order of {ndim} dims")
        return order

    def errors(self, value: Any, where: str, header: CacheHeader) -> dict[str, float]:
        names = {spec.name for spec in header.boundary}
        errors = {}
        for name, error in self.mapping(value, where).items():
            if name not in names:
                self.fail(where, f"names {name!r}, which is not a boundary tensor")
            errors[name] = self.number(error, f"{where}.{name}")
        return errors


def _kind(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"the key {key!r} appears twice in one object")
        document[key] = value
    return document


def _reject_constant(name: str) -> Callable[[], None]:
    raise ValueError(f"{name} is not a JSON number")
