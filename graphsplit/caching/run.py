"""Run stage 1 over a data loader once and store its outputs in a cache folder.

Glossary (the folder's files are described in :mod:`graphsplit.caching.format`):
    row: one sample's slice of a boundary tensor, cut along the tensor's batch dim and stored
        as its own contiguous tensor, so samples of different shapes can share a cache.
    position: a sample's place in the loader's order: its dataset index for a map-style
        ``DataLoader``, else the running count of samples the loader yielded.
    key: the sample's name in the cache: ``batch["key"][row]`` when the loader gives one, else
        ``str(position)``.
    owner: the process that computes and writes a shard: shard ``k`` belongs to process
        ``k % num_processes``; with one process, every shard is its own.

In and out::

    cache(split, dataloader, path, *, accelerator=None, shard_bytes=256 MiB,
          storage_dtype=None, overwrite=False, progress=None) -> CacheInfo

``split`` needs ``stage1`` (a module: ``stage1(**inputs) -> dict[str, Tensor]``), ``boundary``
(``dict[str, BoundarySpec]``) and ``input_names``; :func:`graphsplit.split` returns one.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import re
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from graphsplit.caching.fingerprint import (
    BINDING_PARTS,
    Fingerprint,
    batch_input_digests,
    describe_differences,
    differences,
    fingerprint,
)
from graphsplit.caching.format import (
    CONSTANTS_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    PARTIAL_DIR,
    SHARD_FILE_PATTERN,
    CacheHeader,
    FileRecord,
    Layout,
    Manifest,
    Order,
    ShardRecord,
    fsync_folder,
    memory_order,
    read_constants_record,
    read_manifest,
    read_plan,
    read_shard_record,
    sha256_file,
    shard_file_name,
    tensor_name,
    write_constants_record,
    write_manifest,
    write_plan,
    write_shard_record,
)
from graphsplit.errors import (
    CacheError,
    CacheLockedError,
    CorruptCacheError,
    ManifestError,
    StaleCacheError,
)
from graphsplit.units import human_bytes

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["DEFAULT_SHARD_BYTES", "CacheInfo", "cache"]

DEFAULT_SHARD_BYTES = 256 << 20
_TEMPORARY_FILE = re.compile(r"\..+\.tmp")
_log = logging.getLogger("graphsplit")


@dataclass(frozen=True)
class CacheInfo:
    """What :func:`cache` left in the folder.

    ``reused_shards`` were found finished (a resumed or already complete cache) and kept;
    ``max_abs_error`` is the largest ``|stored - computed|`` per boundary tensor that a lower
    ``storage_dtype`` introduced (empty when storage is lossless).
    """

    path: Path
    num_samples: int
    num_shards: int
    total_bytes: int
    written_shards: int
    reused_shards: int
    storage_dtype: torch.dtype | None
    max_abs_error: Mapping[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [
            f"graphsplit cache at {self.path}: {self.num_samples} samples in {self.num_shards} "
            f"shards, {human_bytes(self.total_bytes)} ({self.written_shards} shards written, "
            f"{self.reused_shards} reused)"
        ]
        if self.storage_dtype is not None:
            errors = ", ".join(f"{name} {error:.3g}" for name, error in self.max_abs_error.items())
            lines.append(f"stored as {self.storage_dtype}; max abs error: {errors or 'none'}")
        return "\n".join(lines)


def cache(
    split: Split,
    dataloader: Any,
    path: str | os.PathLike[str],
    *,
    accelerator: Any = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    storage_dtype: torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> CacheInfo:
    """Run ``split.stage1`` over ``dataloader`` and store its outputs in the folder ``path``.

    Each batch goes through stage 1 under ``torch.inference_mode()``; every boundary tensor is
    cut along its batch dim into per-sample rows, which are written to safetensors shards of
    about ``shard_bytes`` each; per-dataset constants are written once. ``manifest.json`` is
    written last, so a folder with a manifest is a complete cache.

    The run is crash-safe and resumable: every file is written under a temporary name, fsync'd
    and renamed; after an interruption (``kill -9`` included) the same call skips the finished
    shards and ends with the same files as an uninterrupted run. Calling it again on a complete
    cache made from the same weights and code does nothing; on one made from others it refuses
    unless ``overwrite=True``. A lock file keeps two runs from writing one folder.

    The loader must yield the same batches in the same order every time (no shuffling: caching
    gains nothing from it), as dicts holding ``split.input_names`` and optionally ``"key"``, a
    list of unique sample names. Without keys a sample is named by its position in the loader,
    so a changed dataset order would mislabel samples: give keys when you can. Stage 1 runs on
    the device of its own weights; put the model there first.

    Args:
        split: what :func:`graphsplit.split` returned.
        dataloader: a ``torch.utils.data.DataLoader`` (map-style datasets are read by index, so
            resumed and multi-process runs load only what they compute) or any re-iterable of
            batches.
        path: the cache folder; created if missing. It may be on a shared filesystem.
        accelerator: an ``accelerate.Accelerator``. Under ``accelerate launch`` each process
            computes and writes every ``num_processes``-th shard and the main process writes the
            manifest; the result equals a single-process cache, file for file. Pass the plain
            loader, not one returned by ``accelerator.prepare``.
        shard_bytes: the target shard size; a shard holds whole loader batches.
        storage_dtype: ``None`` stores losslessly; ``torch.bfloat16`` or ``torch.float16``
            stores wider floating tensors in that dtype and records the largest error it
            introduced (``CacheInfo.max_abs_error``); :func:`graphsplit.collate` casts back.
        overwrite: replace a cache (complete or partial) made from other weights, code or
            options instead of refusing.
        progress: show a progress bar (samples, bytes written, ETA); ``None`` shows it only on
            a terminal.

    Returns:
        A :class:`CacheInfo` describing the folder.

    Raises:
        CacheError: the disk lacks room, the loader shuffles or yields bad batches, or a
            process failed; StaleCacheError: the folder holds another cache and ``overwrite``
            is false; CacheLockedError: another run is writing the folder.

    Example:
        >>> import tempfile, graphsplit
        >>> class Step(torch.nn.Module):  # a frozen encoder and a trainable head
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.encoder = torch.nn.Linear(4, 4).requires_grad_(False)
        ...         self.head = torch.nn.Linear(4, 1)
        ...     def forward(self, x):
        ...         return self.head(self.encoder(x)).pow(2).mean()
        >>> split = graphsplit.split(Step(), args=(torch.randn(2, 4),))
        >>> data = [{"x": torch.randn(4), "key": f"sample-{i}"} for i in range(6)]
        >>> loader = torch.utils.data.DataLoader(data, batch_size=2)
        >>> info = cache(split, loader, tempfile.mkdtemp(), progress=False)
        >>> info.num_samples, info.num_shards
        (6, 1)
    """
    folder = Path(path)
    storage = _storage_name(storage_dtype)
    if type(shard_bytes) is not int or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    processes = _Processes(accelerator)
    source = _source_for(dataloader, split.input_names)

    # 1. Fingerprint what produces the cache; every process must hold the same weights and code.
    current = fingerprint(split)
    processes.check_same_fingerprint(current)

    # 2. The main process locks the folder and decides: nothing to do, resume, or start afresh.
    lock = _Lock(folder / LOCK_FILE)

    def prepare() -> _Plan:
        folder.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        try:
            return _prepare(folder, split, source, current, storage, shard_bytes, overwrite)
        except BaseException:
            lock.release()
            raise

    plan = processes.on_main(prepare)
    try:
        if plan.complete is not None:
            return plan.complete
        # 3. Every process computes and writes the unfinished shards it owns.
        processes.everywhere(
            lambda: _write_shards(split, source, folder, plan, processes, progress)
        )
        # 4. The main process merges the shard records into the manifest.
        return processes.on_main(lambda: _finish(folder, plan, source))
    finally:
        if processes.is_main:
            lock.release()


# --------------------------------------------------------------------------- deciding what to do


@dataclass(frozen=True)
class _Plan:
    """The main process's decision, sent to every process."""

    header: CacheHeader
    finished: frozenset[int] = frozenset()
    records: Mapping[int, ShardRecord] = field(default_factory=dict)
    complete: CacheInfo | None = None


def _prepare(
    folder: Path,
    split: Any,
    source: _Source,
    current: Fingerprint,
    storage: str | None,
    shard_bytes: int,
    overwrite: bool,
) -> _Plan:
    _remove_temporary_files(folder)
    if source.num_batches == 0:
        raise CacheError("the loader yielded no batches; there is nothing to cache")
    if (folder / MANIFEST_FILE).exists():
        complete = _existing_cache(folder, source, current, storage, overwrite)
        if complete is not None:
            return _Plan(header=complete[0], complete=complete[1])
    header = _resumable_header(folder, split, current, storage, shard_bytes, overwrite)
    records: dict[int, ShardRecord] = {}
    if header is None:
        header = _new_header(split, source, current, storage, shard_bytes)
    else:
        records = _finished_records(folder, header)
        source.check_resumed_order(records, header.layout.batches_per_shard)
    _check_disk_space(folder, header, source, records)
    write_plan(folder, header)
    return _Plan(header=header, finished=frozenset(records), records=records)


def _existing_cache(
    folder: Path, source: _Source, current: Fingerprint, storage: str | None, overwrite: bool
) -> tuple[CacheHeader, CacheInfo] | None:
    """The header and info of a complete cache to keep as it is, or None to rebuild it."""
    try:
        manifest = read_manifest(folder)
    except ManifestError:
        if overwrite:
            _remove_cache_files(folder)
            return None
        raise
    header = manifest.header
    reasons = _header_differences(header, current, storage)
    if reasons and not overwrite:
        raise StaleCacheError(
            f"the folder {folder} holds a graphsplit cache made differently: {reasons}.\n"
            "  fix: pass overwrite=True to replace it, or choose another path"
        )
    if overwrite:
        _remove_cache_files(folder)
        return None
    _warn_about_versions(header.fingerprint, current, folder)
    if source.num_samples is not None and source.num_samples != manifest.num_samples:
        raise StaleCacheError(
            f"the cache at {folder} holds {manifest.num_samples} samples but the loader yields "
            f"{source.num_samples}: samples were added or removed since it was written.\n"
            "  fix: pass overwrite=True to rebuild it"
        )
    _check_files_present(folder, manifest)
    _remove_partial(folder)  # left over if a run stopped right after writing the manifest
    return header, _info(folder, manifest, written=0)


def _resumable_header(
    folder: Path,
    split: Any,
    current: Fingerprint,
    storage: str | None,
    shard_bytes: int,
    overwrite: bool,
) -> CacheHeader | None:
    """The header of an interrupted run that this call continues, or None to start afresh."""
    try:
        header = read_plan(folder)
    except ManifestError:
        if overwrite:
            _remove_cache_files(folder)
            return None
        raise
    if header is None:
        return None
    reasons = _header_differences(header, current, storage)
    if header.layout.shard_bytes != shard_bytes:
        reasons = _and(reasons, f"it used shard_bytes={header.layout.shard_bytes}")
    if header.inputs != tuple(split.input_names):
        reasons = _and(reasons, f"its stage 1 took the inputs {list(header.inputs)}")
    if not reasons:
        _warn_about_versions(header.fingerprint, current, folder)
        return header
    if overwrite:
        _remove_cache_files(folder)
        return None
    raise StaleCacheError(
        f"the folder {folder} holds an unfinished cache started differently: {reasons}.\n"
        "  fix: rerun with the same split and options to finish it, or pass overwrite=True "
        "to discard it"
    )


def _new_header(
    split: Any, source: _Source, current: Fingerprint, storage: str | None, shard_bytes: int
) -> CacheHeader:
    batch_size = source.batch_size()
    header = CacheHeader(
        fingerprint=current,
        inputs=tuple(split.input_names),
        boundary=tuple(split.boundary.values()),
        storage_dtype=storage,
        layout=Layout(batches_per_shard=1, batch_size=batch_size, shard_bytes=shard_bytes),
    )
    batch_bytes = max(1, (batch_size or 1) * _stored_bytes_per_sample(header))
    layout = Layout(max(1, shard_bytes // batch_bytes), batch_size, shard_bytes)
    return replace(header, layout=layout)


def _header_differences(header: CacheHeader, current: Fingerprint, storage: str | None) -> str:
    parts = [part for part in differences(header.fingerprint, current) if part in BINDING_PARTS]
    reasons = describe_differences(header.fingerprint, current, parts=parts)
    if header.storage_dtype != storage:
        reasons = _and(
            reasons,
            f"it stores {header.storage_dtype or 'losslessly'}, this call asks for "
            f"{storage or 'lossless storage'}",
        )
    return reasons


def _warn_about_versions(cached: Fingerprint, current: Fingerprint, folder: Path) -> None:
    if "versions" in differences(cached, current):
        warnings.warn(
            f"the cache at {folder} was written with other library versions; "
            f"{describe_differences(cached, current, parts=['versions'])}. Its weights, code "
            "and boundary match, so it is used as it is.",
            stacklevel=4,
        )


def _finished_records(folder: Path, header: CacheHeader) -> dict[int, ShardRecord]:
    """The shards of an interrupted run whose record and file (checksum included) agree."""
    candidates = []
    for entry in sorted((folder / PARTIAL_DIR).glob("shard-*.json")):
        match = re.fullmatch(r"shard-(\d{5,9})\.json", entry.name)
        record = match and read_shard_record(folder, int(match.group(1)), header)
        if record:
            candidates.append((int(match.group(1)), record))
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:  # hashing releases the GIL
        intact = list(
            pool.map(lambda pair: _file_matches(folder / pair[1].file, pair[1]), candidates)
        )
    records = {index: record for (index, record), ok in zip(candidates, intact) if ok}
    if header.constant_specs and 0 in records:
        constants = read_constants_record(folder, header)
        if constants is None or not _file_matches(folder / CONSTANTS_FILE, constants):
            del records[0]  # shard 0's first batch also writes the constants: redo it
    return records


def _file_matches(path: Path, record: FileRecord) -> bool:
    try:
        return path.stat().st_size == record.bytes and sha256_file(path) == record.sha256
    except OSError:
        return False


def _check_disk_space(
    folder: Path, header: CacheHeader, source: _Source, records: Mapping[int, ShardRecord]
) -> None:
    if source.num_samples is None:
        return  # an iterable without a length: ENOSPC is reported when it happens
    remaining = source.num_samples - sum(len(record.keys) for record in records.values())
    per_sample = _stored_bytes_per_sample(header) + 64 * len(header.sample_specs) + 256
    needed = max(0, remaining) * per_sample
    free = shutil.disk_usage(folder).free
    if needed > free:
        hint = ""
        if header.storage_dtype is None and any(
            spec.dtype.is_floating_point and spec.dtype.itemsize > 2 for spec in header.sample_specs
        ):
            hint = ", or store in lower precision (storage_dtype=torch.bfloat16)"
        raise CacheError(
            f"not enough disk space for the cache at {folder}: it needs about "
            f"{human_bytes(needed)} ({remaining} samples x {human_bytes(per_sample)}) but only "
            f"{human_bytes(free)} are free there.\n"
            f"  fix: free some space or choose another path{hint}"
        )


def _stored_bytes_per_sample(header: CacheHeader) -> int:
    total = 0
    for spec in header.sample_specs:
        ratio = header.stored_dtype(spec).itemsize / max(1, spec.dtype.itemsize)
        total += math.ceil(spec.bytes_per_sample * ratio)
    return total


def _check_files_present(folder: Path, manifest: Manifest) -> None:
    files = [*manifest.shards, *([manifest.constants] if manifest.constants else [])]
    for record in files:
        path = folder / record.file
        size = path.stat().st_size if path.is_file() else None
        if size != record.bytes:
            state = "is missing" if size is None else f"has {size} bytes, not {record.bytes}"
            raise CorruptCacheError(
                f"the cache at {folder} is damaged: {record.file} {state}.\n  fix: run "
                "graphsplit.check_cache(path) for details, or rebuild it with overwrite=True"
            )


# ------------------------------------------------------------------------------ writing shards


@dataclass
class _PendingShard:
    """The rows of one shard, collected in memory until its last batch is done."""

    index: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    shapes: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    orders: list[tuple[Order | None, ...]] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    max_abs_error: dict[str, float] = field(default_factory=dict)
    nbytes: int = 0


def _write_shards(
    split: Any,
    source: _Source,
    folder: Path,
    plan: _Plan,
    processes: _Processes,
    progress: bool | None,
) -> None:
    header = plan.header
    per_shard = header.layout.batches_per_shard

    def wanted(batch_index: int) -> bool:
        shard = batch_index // per_shard
        return shard % processes.world == processes.rank and shard not in plan.finished

    device = _stage1_device(split.stage1, processes.accelerator)
    writer = _ShardWriter(folder)
    shown = progress if processes.is_main else False  # one bar, on the main process
    bar = _progress_bar(shown, source.count(wanted), processes)
    seen_keys: dict[str, int] = {}
    constants: dict[str, torch.Tensor] | None = None
    pending: _PendingShard | None = None
    try:
        for batch in source.batches(wanted, plan.records, per_shard):
            shard = batch.index // per_shard
            if pending is not None and pending.index != shard:
                writer.submit(pending)
                pending = None
            pending = pending or _PendingShard(shard)
            outputs = _run_stage1(split, batch.data, len(batch.positions), device)
            stored, errors = _to_storage(outputs, header)
            constants = _handle_constants(folder, header, stored, errors, batch.index, constants)
            keys = _batch_keys(batch.data, batch.positions)
            _check_new_keys(keys, batch.positions, seen_keys)
            digests = batch_input_digests(
                _as_mapping(batch.data, header.inputs), header.inputs, len(keys)
            )
            _add_rows(pending, header, stored, errors, keys, digests, batch.positions)
            if bar is not None:
                bar.update(len(keys))
                bar.set_postfix_str(
                    f"{human_bytes(writer.bytes_submitted + pending.nbytes)} written"
                )
        if pending is not None:
            writer.submit(pending)
        writer.close()
    except BaseException:
        writer.close(cancel=True)
        raise
    finally:
        if bar is not None:
            bar.close()


def _run_stage1(
    split: Any, batch: Any, size: int, device: torch.device | None
) -> dict[str, torch.Tensor]:
    inputs = _as_mapping(batch, tuple(split.input_names))
    if device is not None:
        inputs = {
            name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()
        }
    with torch.inference_mode():
        outputs = split.stage1(**inputs)
    if not isinstance(outputs, Mapping) or set(outputs) != set(split.boundary):
        found = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise CacheError(
            f"stage 1 returned {found}; the boundary is {list(split.boundary)}.\n"
            "  fix: pass the split whose stage 1 produced this boundary"
        )
    for name, spec in split.boundary.items():
        value = outputs[name]
        if not isinstance(value, torch.Tensor):
            raise CacheError(
                f"stage 1 returned a {type(value).__name__} for {name!r}, not a tensor"
            )
        if spec.batch_dim is not None and (
            value.dim() <= spec.batch_dim or value.shape[spec.batch_dim] != size
        ):
            raise CacheError(
                f"stage 1 returned {name!r} with shape {tuple(value.shape)}, whose batch dim "
                f"{spec.batch_dim} should hold the batch's {size} samples.\n  fix: batch every "
                "input along dim 0 (as a DataLoader does), with one 'key' per sample"
            )
    return dict(outputs)


def _to_storage(
    outputs: Mapping[str, torch.Tensor], header: CacheHeader
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Cast to the storage dtypes (measuring the error) and move to the CPU."""
    stored: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    with torch.inference_mode():
        for spec in header.boundary:
            value = outputs[spec.name]
            dtype = header.stored_dtype(spec)
            if value.dtype != dtype:
                value, errors[spec.name] = _cast(value, dtype, spec.name)
            stored[spec.name] = value.to("cpu")
    return stored, errors


def _cast(value: torch.Tensor, dtype: torch.dtype, name: str) -> tuple[torch.Tensor, float]:
    """``value`` in ``dtype`` and the largest absolute error the cast introduced."""
    stored = value.to(dtype)
    back = stored.to(value.dtype)
    finite = torch.isfinite(value)
    if not bool(torch.isfinite(back)[finite].all()):
        largest = float(value[finite].abs().max())
        raise CacheError(
            f"{name!r} holds values up to {largest:.4g}, beyond the range of {dtype}.\n"
            "  fix: use storage_dtype=torch.bfloat16 (same range as float32) or None (lossless)"
        )
    if value.numel() == 0:
        return stored, 0.0
    return stored, float((back - value).abs().masked_fill(~finite, 0).max())


def _handle_constants(
    folder: Path,
    header: CacheHeader,
    stored: Mapping[str, torch.Tensor],
    errors: Mapping[str, float],
    batch_index: int,
    first: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor] | None:
    """Write the constants from batch 0; check later batches give the same values."""
    if not header.constant_specs:
        return None
    constants = {spec.name: stored[spec.name] for spec in header.constant_specs}
    if first is not None:
        for name, value in constants.items():
            if not torch.equal(value, first[name]):
                raise CacheError(
                    f"the per-dataset constant {name!r} differs between batches, so it is not a "
                    "constant.\n  fix: this is a graphsplit bug in finding batch dims; please "
                    "report it with the step that triggers it"
                )
        return first
    if batch_index == 0:
        orders = {name: memory_order(value) for name, value in constants.items()}
        physical = {
            name: (value if orders[name] is None else value.permute(orders[name])).contiguous()
            for name, value in constants.items()
        }
        path = folder / CONSTANTS_FILE
        temporary = folder / f".{CONSTANTS_FILE}.tmp"
        with _disk_errors(folder, CONSTANTS_FILE):
            _save(physical, temporary, {"format": "pt"})
            size, sha = _commit_file(temporary, path)
        errors = {name: error for name, error in errors.items() if name in constants}
        write_constants_record(folder, FileRecord(CONSTANTS_FILE, sha, size, errors, orders))
    return {name: value.clone() for name, value in constants.items()}


def _add_rows(
    pending: _PendingShard,
    header: CacheHeader,
    stored: Mapping[str, torch.Tensor],
    errors: Mapping[str, float],
    keys: Sequence[str],
    digests: Sequence[str],
    positions: Sequence[int],
) -> None:
    # Rows are stored in the batch tensor's memory order (see manifest.memory_order), as views
    # of one batch-major copy per tensor: one copy per batch, none at all for the usual layouts.
    # safetensors writes non-overlapping views of one storage as separate tensors.
    columns = []
    for spec in header.sample_specs:
        assert spec.batch_dim is not None
        value = stored[spec.name]
        order = memory_order(value)
        physical = value if order is None else value.permute(order)
        position = spec.batch_dim if order is None else order.index(spec.batch_dim)
        row_shape = tuple(size for d, size in enumerate(value.shape) if d != spec.batch_dim)
        columns.append((spec.name, physical.movedim(position, 0).contiguous(), row_shape, order))
    orders = tuple(order for _, _, _, order in columns)
    shapes = tuple(row_shape for _, _, row_shape, _ in columns)
    for offset, key in enumerate(keys):
        row = len(pending.keys)
        for name, values, _, _ in columns:
            value = values[offset]
            pending.tensors[tensor_name(row, name)] = value
            pending.nbytes += value.numel() * value.element_size()
        pending.keys.append(key)
        pending.shapes.append(shapes)
        pending.orders.append(orders)
        pending.digests.append(digests[offset])
        pending.positions.append(int(positions[offset]))
    for spec in header.sample_specs:
        if spec.name in errors:
            error = max(pending.max_abs_error.get(spec.name, 0.0), errors[spec.name])
            pending.max_abs_error[spec.name] = error


class _ShardWriter:
    """Writes shards on background threads, so stage 1 keeps running meanwhile.

    One thread serialises shard ``k`` with ``save_file`` into a temporary file while two others
    hash, fsync and rename the shards before it and record them, so checksums and fsyncs
    overlap the writing. At most one shard waits in memory besides the one being filled.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.bytes_submitted = 0
        self._save = ThreadPoolExecutor(1, thread_name_prefix="graphsplit-save")
        # Two committers: one hashes a shard while the other waits for an fsync.
        self._commit = ThreadPoolExecutor(2, thread_name_prefix="graphsplit-commit")
        self._saving: Future[Future[ShardRecord]] | None = None
        self._commits: list[Future[ShardRecord]] = []

    def submit(self, shard: _PendingShard) -> None:
        self._collect_saving()
        self.bytes_submitted += shard.nbytes
        self._saving = self._save.submit(self._save_shard, shard)

    def close(self, *, cancel: bool = False) -> list[ShardRecord]:
        try:
            self._collect_saving()
            return [commit.result() for commit in self._commits]
        except BaseException:
            if not cancel:
                raise
            return []
        finally:
            self._save.shutdown(wait=True)
            self._commit.shutdown(wait=True)

    def _collect_saving(self) -> None:
        if self._saving is not None:
            saving, self._saving = self._saving, None
            self._commits.append(saving.result())
        for commit in self._commits:
            if commit.done() and commit.exception() is not None:
                commit.result()

    def _save_shard(self, shard: _PendingShard) -> Future[ShardRecord]:
        temporary = self.folder / f".{shard_file_name(shard.index)}.tmp"
        # One metadata entry only: safetensors writes a dict's entries in a random order per
        # process, and resumed or multi-process runs must write byte-identical shards.
        metadata = {"graphsplit_keys": json.dumps(shard.keys)}
        with _disk_errors(self.folder, shard_file_name(shard.index)):
            _save(shard.tensors, temporary, metadata)
        shard.tensors = {}
        return self._commit.submit(self._commit_shard, shard, temporary)

    def _commit_shard(self, shard: _PendingShard, temporary: Path) -> ShardRecord:
        name = shard_file_name(shard.index)
        with _disk_errors(self.folder, name):
            size, sha = _commit_file(temporary, self.folder / name)
            record = ShardRecord(
                file=name,
                sha256=sha,
                bytes=size,
                max_abs_error=shard.max_abs_error,
                keys=tuple(shard.keys),
                shapes=tuple(shard.shapes),
                row_orders=tuple(shard.orders),
                input_sha256=tuple(shard.digests),
                positions=tuple(shard.positions),
            )
            write_shard_record(self.folder, record)
        return record


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    try:
        save_file(tensors, path, metadata=metadata)
    except RuntimeError as error:  # views that overlap, or a safetensors that refuses views
        if "share memory" not in str(error):
            raise
        save_file({name: value.clone() for name, value in tensors.items()}, path, metadata)


def _commit_file(temporary: Path, path: Path) -> tuple[int, str]:
    """Hash and fsync a finished temporary file, then rename it into place.

    The folder is fsync'd once, before the manifest is written (see :func:`_finish`): until
    then a rename lost to a power cut only means the shard is redone on resume.
    """
    sha = sha256_file(temporary)
    descriptor = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        size = os.fstat(descriptor).st_size
    finally:
        os.close(descriptor)
    os.replace(temporary, path)
    return size, sha


@contextlib.contextmanager
def _disk_errors(folder: Path, name: str) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheError(
                f"the disk holding {folder} ran full while writing {name}.\n  fix: free some "
                "space and rerun the same graphsplit.cache call: finished shards are kept"
            ) from error
        raise


# ------------------------------------------------------------------------------------ finishing


def _finish(folder: Path, plan: _Plan, source: _Source) -> CacheInfo:
    header = plan.header
    num_batches = source.num_batches
    assert num_batches is not None, "the main process has iterated the whole loader"
    if num_batches == 0:
        raise CacheError("the loader yielded no batches; there is nothing to cache")
    num_shards = math.ceil(num_batches / header.layout.batches_per_shard)
    shards = []
    for index in range(num_shards):
        record = read_shard_record(folder, index, header)
        if record is None or not (folder / record.file).is_file():
            raise CacheError(
                f"shard {index} of {folder} was not written (a process stopped early?).\n"
                "  fix: rerun the same graphsplit.cache call to finish the cache"
            )
        shards.append(record)
    _check_unique_keys(folder, shards)
    constants = None
    if header.constant_specs:
        constants = read_constants_record(folder, header)
        if constants is None:
            raise CacheError(f"{CONSTANTS_FILE} of {folder} was not written; rerun to finish it")
    errors: dict[str, float] = {}
    for record in [*shards, *([constants] if constants else [])]:
        for name, error in record.max_abs_error.items():
            errors[name] = max(errors.get(name, 0.0), error)
    manifest = Manifest(
        header=header,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        constants=None
        if constants is None
        else FileRecord(
            constants.file, constants.sha256, constants.bytes, dim_orders=constants.dim_orders
        ),
        shards=tuple(
            ShardRecord(
                file=shard.file,
                sha256=shard.sha256,
                bytes=shard.bytes,
                keys=shard.keys,
                shapes=shard.shapes,
                row_orders=shard.row_orders,
                input_sha256=shard.input_sha256,
            )
            for shard in shards
        ),
        max_abs_error={
            spec.name: errors[spec.name] for spec in header.boundary if spec.name in errors
        },
    )
    fsync_folder(folder)  # every shard's rename is durable before the manifest names it
    write_manifest(folder, manifest)
    _remove_partial(folder)
    return _info(folder, manifest, written=num_shards - len(plan.finished))


def _check_unique_keys(folder: Path, shards: Sequence[ShardRecord]) -> None:
    seen: dict[str, str] = {}
    repeated: list[str] = []
    for shard in shards:
        for key in shard.keys:
            if key in seen:
                repeated.append(f"{key!r} ({seen[key]} and {shard.file})")
            seen.setdefault(key, shard.file)
    if repeated:
        raise CacheError(
            f"the loader gave {len(repeated)} sample key(s) more than once: "
            f"{', '.join(repeated[:5])}.\n  fix: give every sample a unique 'key' and rerun "
            f"with overwrite=True (the partial cache in {folder} is kept until then)"
        )


def _check_new_keys(keys: Sequence[str], positions: Sequence[int], seen: dict[str, int]) -> None:
    for key, position in zip(keys, positions):
        if key in seen:
            raise CacheError(
                f"the loader gave the sample key {key!r} twice (positions {seen[key]} and "
                f"{position}).\n  fix: give every sample a unique 'key' and rerun with "
                "overwrite=True"
            )
        seen[key] = position


def _info(folder: Path, manifest: Manifest, *, written: int) -> CacheInfo:
    storage = manifest.header.storage_dtype
    total = sum(shard.bytes for shard in manifest.shards)
    total += manifest.constants.bytes if manifest.constants else 0
    return CacheInfo(
        path=folder,
        num_samples=manifest.num_samples,
        num_shards=len(manifest.shards),
        total_bytes=total,
        written_shards=written,
        reused_shards=len(manifest.shards) - written,
        storage_dtype=None if storage is None else getattr(torch, storage),
        max_abs_error=dict(manifest.max_abs_error),
    )


# --------------------------------------------------------------------------------- files, lock


def _remove_temporary_files(folder: Path) -> None:
    for directory in (folder, folder / PARTIAL_DIR):
        if directory.is_dir():
            for entry in directory.iterdir():
                if _TEMPORARY_FILE.fullmatch(entry.name) and entry.is_file():
                    entry.unlink()


def _remove_cache_files(folder: Path) -> None:
    """Delete the files graphsplit wrote (the manifest first), nothing else in the folder."""
    (folder / MANIFEST_FILE).unlink(missing_ok=True)
    for entry in folder.iterdir():
        if entry.is_file() and (
            SHARD_FILE_PATTERN.fullmatch(entry.name)
            or entry.name == CONSTANTS_FILE
            or _TEMPORARY_FILE.fullmatch(entry.name)
        ):
            entry.unlink()
    _remove_partial(folder)


def _remove_partial(folder: Path) -> None:
    partial = folder / PARTIAL_DIR
    if not partial.is_dir():
        return
    for entry in partial.iterdir():
        if entry.is_file() and (entry.suffix == ".json" or _TEMPORARY_FILE.fullmatch(entry.name)):
            entry.unlink()
    with contextlib.suppress(OSError):
        partial.rmdir()


class _Lock:
    """An exclusive lock file holding the writer's pid, host and process start time.

    It is created with ``os.link`` from a private file, which is atomic (NFS included) and
    fails if the lock exists. A lock whose process is gone from this host is stale and taken
    over; any other lock is refused with a message saying who holds it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.held = False

    def acquire(self) -> None:
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _process_start(os.getpid()),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        private = self.path.with_name(f".lock-{owner['host']}-{owner['pid']}")
        private.write_text(json.dumps(owner))
        try:
            for _ in range(2):
                try:
                    _create_exclusively(private, self.path)
                    self.held = True
                    return
                except FileExistsError:
                    holder = self._holder()
                    if not _is_stale(holder):
                        raise self._locked_error(holder) from None
                    _log.warning("graphsplit: removing the stale lock %s (%s)", self.path, holder)
                    self.path.unlink(missing_ok=True)
            raise self._locked_error(self._holder())
        finally:
            private.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _holder(self) -> dict[str, Any]:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else {}
        except (OSError, ValueError):
            return {}

    def _locked_error(self, holder: Mapping[str, Any]) -> CacheLockedError:
        who = (
            f"process {holder.get('pid')} on host {holder.get('host')!r} "
            f"since {holder.get('since')}"
            if holder
            else "an unknown process (the lock file is unreadable)"
        )
        return CacheLockedError(
            f"the cache folder {self.path.parent} is being written by {who}.\n  fix: wait for "
            f"that run to finish; if it is no longer running, delete {self.path}"
        )


def _create_exclusively(source: Path, path: Path) -> None:
    """Create ``path`` with ``source``'s content, or raise FileExistsError if it exists."""
    try:
        os.link(source, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: exclusive create, then write
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(source.read_bytes())


def _is_stale(holder: Mapping[str, Any]) -> bool:
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    started = holder.get("started")
    return started is not None and started != _process_start(pid)  # the pid was reused


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell reused pids apart."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


# ----------------------------------------------------------------------------------- the loader


@dataclass
class _Batch:
    index: int
    positions: list[int]
    data: Any


class _Source:
    """The loader's batches, numbered; only the wanted ones are loaded where possible."""

    num_samples: int | None = None
    num_batches: int | None = None

    def batch_size(self) -> int | None:
        raise NotImplementedError

    def count(self, wanted: Callable[[int], bool]) -> int | None:
        """How many samples the wanted batches hold, where known in advance."""
        return None

    def batches(
        self, wanted: Callable[[int], bool], finished: Mapping[int, ShardRecord], per_shard: int
    ) -> Iterator[_Batch]:
        raise NotImplementedError

    def check_resumed_order(self, finished: Mapping[int, ShardRecord], per_shard: int) -> None:
        """Refuse to resume when finished shards hold other positions than the loader gives."""


class _IndexedSource(_Source):
    """A DataLoader over a map-style dataset: every batch's dataset indices are known upfront,
    so a process loads only the batches it computes, through a loader built like the user's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.index_lists = [list(indices) for indices in loader.batch_sampler]
        self.num_batches = len(self.index_lists)
        self.num_samples = sum(len(indices) for indices in self.index_lists)

    def batch_size(self) -> int | None:
        return self.loader.batch_size or (len(self.index_lists[0]) if self.index_lists else None)

    def count(self, wanted: Callable[[int], bool]) -> int | None:
        return sum(len(indices) for j, indices in enumerate(self.index_lists) if wanted(j))

    def batches(
        self, wanted: Callable[[int], bool], finished: Mapping[int, ShardRecord], per_shard: int
    ) -> Iterator[_Batch]:
        from torch.utils.data import DataLoader

        chosen = [j for j in range(self.num_batches) if wanted(j)]
        if not chosen:
            return
        loader = self.loader
        options: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": loader.generator,
        }
        if loader.num_workers > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        subset = DataLoader(
            loader.dataset, batch_sampler=[self.index_lists[j] for j in chosen], **options
        )
        for j, data in zip(chosen, subset):
            yield _Batch(j, self.index_lists[j], data)

    def check_resumed_order(self, finished: Mapping[int, ShardRecord], per_shard: int) -> None:
        for shard, record in finished.items():
            lists = self.index_lists[shard * per_shard : (shard + 1) * per_shard]
            expected = [position for indices in lists for position in indices]
            if list(record.positions) != expected:
                raise _order_changed(shard)


class _StreamSource(_Source):
    """Any other iterable of batches: every process iterates all of it and skips what it
    does not compute (loading it, but not running stage 1 on it)."""

    def __init__(self, loader: Any, input_names: Sequence[str]) -> None:
        self.loader = loader
        self.input_names = tuple(input_names)
        self._peeked: tuple[Any, Iterator[Any]] | None = None
        dataset = getattr(loader, "dataset", None)
        with contextlib.suppress(TypeError):
            self.num_samples = len(dataset) if dataset is not None else None

    def batch_size(self) -> int | None:
        if self._peeked is None:
            iterator = iter(self.loader)
            try:
                first = next(iterator)
            except StopIteration:
                raise CacheError(
                    "the loader yielded no batches; there is nothing to cache"
                ) from None
            self._peeked = (first, iterator)
        return _batch_length(self._peeked[0], self.input_names)

    def batches(
        self, wanted: Callable[[int], bool], finished: Mapping[int, ShardRecord], per_shard: int
    ) -> Iterator[_Batch]:
        if self._peeked is not None:
            first, rest = self._peeked
            self._peeked = None
            iterator: Iterator[Any] = itertools.chain([first], rest)
        else:
            iterator = iter(self.loader)
        position = 0
        skipped: dict[int, list[str]] = {}
        count = 0
        for j, data in enumerate(iterator):
            size = _batch_length(data, self.input_names)
            positions = list(range(position, position + size))
            position += size
            count = j + 1
            shard = j // per_shard
            if shard in finished:
                skipped.setdefault(shard, []).extend(_batch_keys(data, positions))
                complete = len(skipped[shard]) >= len(finished[shard].keys)
                if complete and skipped.pop(shard) != list(finished[shard].keys):
                    raise _order_changed(shard)
            if wanted(j):
                yield _Batch(j, positions, data)
        if skipped:
            raise _order_changed(min(skipped))
        self.num_batches = count


def _source_for(loader: Any, input_names: Sequence[str]) -> _Source:
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if type(loader).__module__.startswith("accelerate"):
        raise CacheError(
            "graphsplit.cache got a loader returned by accelerator.prepare, which already "
            "splits the data between processes.\n  fix: pass the plain DataLoader and the "
            "accelerator: graphsplit.cache(split, loader, path, accelerator=accelerator)"
        )
    if isinstance(loader, DataLoader):
        batch_sampler = loader.batch_sampler
        samplers = [loader.sampler, getattr(batch_sampler, "sampler", None)]
        if any(isinstance(sampler, (RandomSampler, DistributedSampler)) for sampler in samplers):
            raise CacheError(
                "the loader shuffles or splits its dataset (its sampler is a "
                f"{type(loader.sampler).__name__}); caching needs the same order on every run "
                "and in every process.\n  fix: build the loader with shuffle=False and no "
                "sampler (shuffle the cached dataset when training instead)"
            )
        if not isinstance(loader.dataset, IterableDataset) and batch_sampler is not None:
            return _IndexedSource(loader)
    return _StreamSource(loader, input_names)


def _order_changed(shard: int) -> CacheError:
    return StaleCacheError(
        f"the loader yields other samples for shard {shard} than the interrupted run did "
        "(its order or dataset changed), so the run cannot resume.\n  fix: use the same loader "
        "without shuffling, or pass overwrite=True to start the cache afresh"
    )


def _as_mapping(batch: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(batch, Mapping):
        missing = [name for name in names if name not in batch]
        if missing:
            raise CacheError(
                f"the loader's batches lack {missing}; stage 1 takes {list(names)} and the "
                f"batches hold {sorted(map(str, batch))}.\n  fix: return these fields from "
                "the dataset (or the collate function)"
            )
        return {name: batch[name] for name in names}
    if isinstance(batch, (list, tuple)) and len(batch) == len(names):
        return dict(zip(names, batch))
    raise CacheError(
        f"a batch is a {type(batch).__name__}; graphsplit.cache needs a dict holding "
        f"{list(names)} (and optionally 'key').\n  fix: make the dataset return dicts"
    )


def _batch_length(batch: Any, names: Sequence[str]) -> int:
    sizes = [
        int(value.shape[0])
        for value in _as_mapping(batch, names).values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    if isinstance(batch, Mapping) and "key" in batch:
        keys = len(batch["key"])
        if sizes and sizes[0] != keys:
            raise CacheError(
                f"the batch's 'key' lists {keys} key(s) but its inputs hold {sizes[0]} samples."
                "\n  fix: give one key per sample"
            )
        return keys
    if sizes:
        return sizes[0]
    raise CacheError(
        "cannot tell how many samples a batch holds: it has no 'key' list and no batched "
        f"tensor among {list(names)}.\n  fix: give each batch a 'key' list"
    )


def _batch_keys(batch: Any, positions: Sequence[int]) -> list[str]:
    raw = batch.get("key") if isinstance(batch, Mapping) else None
    if raw is None:
        return [str(position) for position in positions]
    if isinstance(raw, torch.Tensor):
        raw = raw.tolist()
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) != len(positions):
        raise CacheError(
            f"the batch's 'key' is {type(raw).__name__} {raw!r:.60}; it must be a list with one "
            f"key per sample ({len(positions)} here)"
        )
    return [str(key) for key in raw]


def _stage1_device(stage1: torch.nn.Module, accelerator: Any) -> torch.device | None:
    for tensor in itertools.chain(stage1.parameters(), stage1.buffers()):
        return tensor.device
    return None if accelerator is None else accelerator.device


def _storage_name(storage_dtype: torch.dtype | None) -> str | None:
    if storage_dtype is None:
        return None
    if storage_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"storage_dtype must be None (lossless), torch.bfloat16 or torch.float16, "
            f"got {storage_dtype!r}"
        )
    return str(storage_dtype).removeprefix("torch.")


def _progress_bar(enabled: bool | None, total: int | None, processes: _Processes) -> Any:
    if enabled is False:
        return None
    from tqdm.auto import tqdm

    description = "caching" if processes.world == 1 else f"caching (process 0 of {processes.world})"
    return tqdm(
        total=total,
        desc=description,
        unit="sample",
        disable=None if enabled is None else not enabled,
        dynamic_ncols=True,
    )


def _and(reasons: str, reason: str) -> str:
    return f"{reasons}; {reason}" if reasons else reason


# ------------------------------------------------------------------------------------ processes


class _Processes:
    """The processes of an ``accelerate`` launch (or just this one) and how they agree.

    ``on_main`` runs a step on the main process and hands its result, or its error, to all;
    ``everywhere`` runs a step on every process and raises on all of them if any failed, so no
    process waits forever for one that died.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.rank = 0 if accelerator is None else int(accelerator.process_index)
        self.world = 1 if accelerator is None else int(accelerator.num_processes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def on_main(self, step: Callable[[], Any]) -> Any:
        if self.world == 1:
            return step()
        from accelerate.utils import broadcast_object_list

        outcome: list[Any] = [None]
        error: BaseException | None = None
        if self.is_main:
            try:
                outcome = [("ok", step())]
            except Exception as caught:
                error = caught
                outcome = [("error", _describe_error(caught))]
        broadcast_object_list(outcome, from_process=0)
        if error is not None:
            raise error
        status, value = outcome[0]
        if status == "error":
            raise _remote_error(value, 0)
        return value

    def everywhere(self, step: Callable[[], Any]) -> None:
        if self.world == 1:
            step()
            return
        from accelerate.utils import gather_object

        error: BaseException | None = None
        try:
            step()
            outcome: Any = None
        except Exception as caught:
            error = caught
            outcome = _describe_error(caught)
        outcomes = gather_object([outcome])
        if error is not None:
            raise error
        for rank, described in enumerate(outcomes):
            if described is not None:
                raise _remote_error(described, rank)

    def check_same_fingerprint(self, current: Fingerprint) -> None:
        if self.world == 1:
            return
        from accelerate.utils import gather_object

        everyone = gather_object([current.to_json()])
        for rank, other in enumerate(everyone):
            mine = current.to_json()
            parts = [part for part in ("weights", "code", "boundary") if other[part] != mine[part]]
            if parts:
                raise CacheError(
                    f"process {rank} has other {' and '.join(parts)} than process "
                    f"{self.rank}, so their caches would not agree.\n  fix: build the model the "
                    "same way in every process (seed random initialisation, load the same "
                    "checkpoint) before splitting it"
                )


def _describe_error(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


def _remote_error(described: tuple[str, str], rank: int) -> BaseException:
    import graphsplit.errors as errors

    name, message = described
    kind = getattr(errors, name, None)
    if not (isinstance(kind, type) and issubclass(kind, CacheError)):
        kind, message = CacheError, f"{name}: {message}"
    return kind(f"process {rank} failed: {message}")
