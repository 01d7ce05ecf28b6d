"""Run stage 1 over a data loader once and store its outputs in a cache folder.

``cache`` narrates the run; each step is a module of its own:

    1. fingerprint   what produces the cache (caching.format.fingerprint); every process agrees
    2. decide        lock the folder (caching.store.lock); nothing to do, resume, or start afresh
                     (caching.write.folder_decision)
    3. write shards  every process computes and writes the shards it owns (caching.write.shards,
                     batches from caching.loader.batches, processes from caching.write.processes)
    4. finish        the main process merges the progress records into the manifest (here)

The folder's files are described in :mod:`graphsplit.caching.format.layout`.

Glossary:
    reused shard: a shard an earlier run finished (a resumed or already complete cache), kept.
    written shard: a shard this call computed and wrote.

In and out::

    cache(split, dataloader, path, *, accelerator=None, shard_bytes=256 MiB,
          storage_dtype=None, overwrite=False, progress=None, durable=True) -> CacheInfo

``split`` needs ``stage1`` (a module: ``stage1(**inputs) -> dict[str, Tensor]``), ``boundary``
(``dict[str, BoundarySpec]``) and ``input_names``; :func:`graphsplit.split` returns one.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphsplit.caching.format.fingerprint import fingerprint
from graphsplit.caching.format.layout import (
    CONSTANTS_FILE,
    LOCK_FILE,
    Manifest,
    PlanRecord,
    ShardProgress,
    ShardRecord,
    constants_records,
)
from graphsplit.caching.loader.batches import BatchSource, empty_loader_error, source_for
from graphsplit.caching.loader.random_samples import frozen_augmentation_text, random_fields
from graphsplit.caching.store import file_writes, regular_files
from graphsplit.caching.store.durability import unsynced_record
from graphsplit.caching.store.lock import FolderLock
from graphsplit.caching.store.record_files import (
    read_constants_progress,
    read_shard_progress,
    write_manifest,
)
from graphsplit.caching.store.remote import RemotePath, location, make_folder
from graphsplit.caching.store.remote_lock import RemoteLock
from graphsplit.caching.write.folder_decision import Decision, decide, remove_progress
from graphsplit.caching.write.plan_constants import refuse_unrecorded_constants
from graphsplit.caching.write.plan_rows import plan_record
from graphsplit.caching.write.processes import Processes
from graphsplit.caching.write.shards import write_shards
from graphsplit.errors import CacheError, Fix, RandomDatasetWarning, Remedy, user_error
from graphsplit.signatures.defaults import batch_input_names
from graphsplit.units import human_bytes

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["DEFAULT_SHARD_BYTES", "CacheInfo", "cache"]

DEFAULT_SHARD_BYTES = 256 << 20


@dataclass(frozen=True)
class CacheInfo:
    """What :func:`cache` left in the folder.

    ``reused_shards`` were found finished (a resumed or already complete cache) and kept;
    ``max_abs_error`` is the largest ``|stored - computed|`` per boundary tensor that a lower
    ``storage_dtype`` introduced (empty when storage is lossless).
    """

    path: Path | RemotePath
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
    durable: bool = True,
) -> CacheInfo:
    """Run ``split.stage1`` over ``dataloader`` and store its outputs in the folder ``path``.

    Each batch goes through stage 1 under ``torch.inference_mode()``; every boundary tensor is
    cut along its batch dim into per-sample rows, which are written to safetensors shards of
    about ``shard_bytes`` each; per-dataset constants are written once. ``manifest.json`` is
    written last, so a folder with a manifest is a complete cache.

    The run is crash-safe and resumable: every file is written under a temporary name, fsync'd
    and renamed; after an interruption (``kill -9`` included) the same call skips the finished
    shards and ends with the same files as an uninterrupted run. With ``durable=False`` the
    fsyncs are skipped (the files are the same): the cache is as safe as one written with a
    bare ``safetensors.save_file``, which a crash of the process cannot harm but a power cut
    can, and it is never read wrong after one: its manifest records the boot that wrote it,
    and in any other boot every file's checksum is checked before it is used. Calling it again
    on a complete cache made from the same weights, code and samples does nothing (it reads
    the loader once to compare each sample's key and input digest); on one made from others
    it refuses unless ``overwrite=True``. A lock (``flock``) keeps two runs from writing one folder.

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
        path: the cache folder; created if missing. It may be on a shared filesystem, or a
            URL of any fsspec filesystem (``"s3://bucket/cache"``, ``"gs://..."``,
            ``"hf://..."``; ``"file://..."`` is a local folder): shards are then uploaded
            whole, the manifest last, and the lock is a lock object (see
            :mod:`graphsplit.caching.store.remote_lock`). Pass URLs as strings: ``pathlib.Path``
            turns ``s3://b`` into ``s3:/b``, which is refused, never made a local folder.
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
        durable: fsync every file before anything names it, so the cache survives a power
            cut. ``False`` writes without fsyncs, as fast as the page cache takes the bytes
            (the disk writes them later): resuming after ``kill -9`` still works, but after
            the machine restarts ``CachedDataset`` verifies every shard on first use (as with
            ``verify=True``) and a damaged one raises ``CorruptCacheError``; calling ``cache``
            again verifies them all once and, if they match, fsyncs them and records the
            cache as durable. A cache on an object store is durable either way (a put is).

    Returns:
        A :class:`CacheInfo` describing the folder.

    Raises:
        CacheError: the loader shuffles or yields bad batches, the path is a file, or a
            process failed; DiskFullError: no room for a file (rerun to resume);
            StaleCacheError: the folder holds another cache, or one of other samples (keys or
            inputs), and ``overwrite`` is false; CacheLockedError: another run is writing the
            folder; UnsafeFileError: a file of the folder is a symlink, FIFO or device;
            UnsupportedStorageError: a URL fsspec cannot open; StorageError: the store failed
            a request (rerun to resume).

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
    folder = location(path)
    storage = _storage_name(storage_dtype)
    if type(shard_bytes) is not int or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    processes = Processes(accelerator)
    source = source_for(dataloader, batch_input_names(split))
    _warn_about_random_datasets(source)

    # 1. Fingerprint what produces the cache; every process must hold the same weights and code.
    current = fingerprint(split)
    processes.refuse_other_fingerprints(current)

    # 2. The main process locks the folder and decides: nothing to do, resume, or start afresh.
    if isinstance(folder, RemotePath):
        lock: FolderLock | RemoteLock = RemoteLock(folder / LOCK_FILE)
    else:
        lock = FolderLock(folder / LOCK_FILE, durable=durable)

    def locked_decision() -> Decision:
        _make_folder(folder)
        lock.acquire()
        try:
            return decide(
                folder,
                split,
                source,
                current,
                storage_dtype=storage,
                shard_bytes=shard_bytes,
                overwrite=overwrite,
                durable=durable,
            )
        except BaseException:
            lock.release()
            raise

    decision = processes.on_main(locked_decision)
    try:
        if decision.complete is not None:
            return _info(folder, decision.complete, written=0)
        # 3. Every process computes and writes the unfinished shards it owns.
        written: dict[int, ShardProgress] = {}  # this process's records, kept in memory
        processes.everywhere(
            lambda: written.update(
                write_shards(
                    split,
                    source,
                    folder,
                    header=decision.header,
                    finished=decision.finished,
                    processes=processes,
                    progress=progress,
                    durable=durable,
                )
            )
        )
        # 4. The main process merges the progress records into the manifest.
        return processes.on_main(
            lambda: _finish(folder, decision, source, written, lock, split, durable=durable)
        )
    finally:
        if processes.is_main:
            lock.release()


def _warn_about_random_datasets(source: BatchSource) -> None:
    """Say so when the dataset draws random numbers: the cache freezes one draw per sample."""
    source.random_fields = random_fields(source)
    if source.random_fields:
        warnings.warn(
            RandomDatasetWarning(
                f"{frozen_augmentation_text(source)}. To train on new draws every epoch, keep the "
                "augmentation out of the cached work (do it in the step after the frozen "
                "calls, where that suits the model), or cache a deterministic dataset "
                "(CenterCrop, no random flip); to accept one draw per sample, filter "
                "graphsplit.errors.RandomDatasetWarning."
            ),
            stacklevel=3,
        )


def _finish(
    folder: Path | RemotePath,
    decision: Decision,
    source: BatchSource,
    written: Mapping[int, ShardProgress],
    lock: FolderLock | RemoteLock,
    split: Any,
    *,
    durable: bool,
) -> CacheInfo:
    """Write the manifest from the progress records, then drop them; the cache is complete.

    ``written`` holds the records this process wrote; only the others are read back. On an
    object store the lock is confirmed first (its fence), so only its holder publishes.
    Without ``durable`` nothing is fsync'd and the manifest records the boot (the renames
    and the manifest still come in this order, so a crash of the process leaves a cache
    that resumes, and the lock is released only after the manifest is in place).
    """
    header = decision.header
    num_batches = source.num_batches
    assert num_batches is not None, "the main process has iterated the whole loader"
    if num_batches == 0:
        raise empty_loader_error()
    num_shards = math.ceil(num_batches / header.layout.batches_per_shard)
    shards = []
    errors: dict[str, float] = {}
    plans: dict[str, PlanRecord] = {}
    for index in range(num_shards):
        progress = written.get(index) or read_shard_progress(folder, index, header)
        if progress is None or regular_files.regular_size(folder / progress.shard.file) is None:
            raise user_error(
                CacheError,
                f"shard {index} of {folder} was not written (a process stopped early?).",
                fix=Fix("rerun the same graphsplit.cache call to finish the cache"),
            )
        shards.append(progress.shard)
        plans.update(progress.plans or {})
        _add_errors(errors, progress.max_abs_error)
    _refuse_repeated_keys(folder, shards)
    first = getattr(getattr(split, "plan_set", None), "first", None)
    refuse_unrecorded_constants(folder, header, shards, plans, first and first.key)
    constants = None
    if header.constant_specs:
        written = read_constants_progress(folder, header)
        if written is None:
            raise user_error(
                CacheError,
                f"{CONSTANTS_FILE} of {folder} was not written",
                fix=Fix("rerun the same graphsplit.cache call to finish it"),
            )
        constants = written.constants
        _add_errors(errors, written.max_abs_error)
    manifest = Manifest(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        unsynced=unsynced_record(folder, durable=durable),
        header=header,
        num_samples=sum(len(shard.keys) for shard in shards),
        max_abs_error={
            spec.name: errors[spec.name] for spec in header.boundary if spec.name in errors
        },
        constants=constants,
        shards=tuple(shards),
        **_plans_of(split, plans),
    )
    if durable:
        _make_durable(folder, manifest, decision)
    if isinstance(lock, RemoteLock):
        lock.confirm()
    write_manifest(folder, manifest, durable=durable)
    remove_progress(folder)
    return _info(folder, manifest, written=num_shards - len(decision.finished))


def _plans_of(split: Any, plans: dict[str, PlanRecord]) -> dict[str, Any]:
    """The manifest's ``plans`` and ``first_plan``: none for a cache of the first plan alone
    (its manifest is what it always was)."""
    plan_set = getattr(split, "plan_set", None)
    if not plans or plan_set is None:
        return {}
    first = plan_set.first
    ordered = {first.key: plan_record(first)} | plans
    return {"plans": ordered, "first_plan": first.key}


def _make_durable(folder: Path | RemotePath, manifest: Manifest, decision: Decision) -> None:
    """Before a durable manifest names them: fsync the files an earlier run left (it may have
    written them with ``durable=False``; an fsync of a file already on the disk is cheap),
    then the folder, so every rename survives a power cut."""
    for index in decision.finished:
        file_writes.fsync_file(folder / manifest.shards[index].file)
    if manifest.constants is not None and 0 in decision.finished:
        file_writes.fsync_file(folder / manifest.constants.file)
    for record in constants_records(manifest)[1:]:  # plans' own: an earlier run may have left
        file_writes.fsync_file(folder / record.file)
    file_writes.fsync_folder(folder)


def _make_folder(folder: Path | RemotePath) -> None:
    """Create the cache folder (and its parents); a file in its place is a CacheError. On an
    object store, check that its bucket exists (none is ever created)."""
    if isinstance(folder, RemotePath):
        make_folder(folder)
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise user_error(
            CacheError,
            f"the cache path {folder} (or a folder above it) is an existing file, not a folder.",
            fix=Fix("pass the path of a folder (it is created if missing), or move the file away"),
        ) from None
    except PermissionError as error:
        raise user_error(
            CacheError,
            f"cannot create the cache folder {folder} ({error.strerror}).",
            fix=Fix("choose a path you can write to"),
        ) from None


def _add_errors(errors: dict[str, float], more: Mapping[str, float]) -> None:
    for name, error in more.items():
        errors[name] = max(errors.get(name, 0.0), error)


def _refuse_repeated_keys(folder: Path, shards: Sequence[ShardRecord]) -> None:
    seen: dict[str, str] = {}
    repeated: list[str] = []
    for shard in shards:
        for key in shard.keys:
            if key in seen:
                repeated.append(f"{key!r} ({seen[key]} and {shard.file})")
            seen.setdefault(key, shard.file)
    if repeated:
        raise user_error(
            CacheError,
            f"the loader gave {len(repeated)} sample key(s) more than once: "
            f"{', '.join(repeated[:5])}.",
            fix=Fix(
                "give every sample a unique 'key' and rerun with {remedy} (the partial cache in "
                f"{folder} is kept until then)",
                Remedy.OVERWRITE,
            ),
        )


def _info(folder: Path | RemotePath, manifest: Manifest, *, written: int) -> CacheInfo:
    storage = manifest.header.storage_dtype
    total = sum(shard.bytes for shard in manifest.shards)
    total += sum(record.bytes for record in constants_records(manifest))
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


def _storage_name(storage_dtype: torch.dtype | None) -> str | None:
    if storage_dtype is None:
        return None
    if storage_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"storage_dtype must be None (lossless), torch.bfloat16 or torch.float16, "
            f"got {storage_dtype!r}"
        )
    return str(storage_dtype).removeprefix("torch.")
