"""What a :func:`graphsplit.cache` call does with its folder: nothing, resume, or start afresh.

Glossary:
    decision: what the main process decided, sent to every process: the header the run
        writes under, the finished shards an interrupted run left (kept), or the complete
        manifest when there is nothing to do.
    binding difference: other frozen weights, stage-1 code or boundary (the fingerprint), or
        another storage dtype: the folder's cache is not this call's, so it is refused unless
        ``overwrite``. Other library versions only warn.
    graphsplit's files: the manifest, shards, constants, temporary files and ``.partial/``,
        recognised by name and content (:mod:`graphsplit.caching.write.own_files`);
        overwriting deletes those and nothing else in the folder. A folder holding another
        tool's ``manifest.json`` is refused, ``overwrite`` or not.
    restarted: a complete cache written with ``durable=False`` in another boot (see
        :mod:`graphsplit.caching.store.durability`): it is kept only once every file's checksum
        matches; then its files are fsync'd and it is recorded as durable.

In and out::

    decide(folder, split, source, current, *, storage_dtype, shard_bytes, overwrite, durable)
        -> Decision(header, finished={shard: ShardProgress}, complete=Manifest | None)
    remove_progress(folder)        # .partial/, once the manifest is written
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from graphsplit.caching.format.fingerprint import (
    BINDING_PARTS,
    Fingerprint,
    describe_differences,
    in_terms_of,
    warn_about_versions,
)
from graphsplit.caching.format.layout import (
    CONSTANTS_FILE,
    MANIFEST_FILE,
    PARTIAL_DIR,
    PLAN_CONSTANTS_PATTERN,
    SHARD_FILE_PATTERN,
    SHARD_PROGRESS_PATTERN,
    CacheHeader,
    Manifest,
    ShardLayout,
    ShardProgress,
    constants_records,
)
from graphsplit.caching.loader.batches import BatchSource, empty_loader_error
from graphsplit.caching.loader.random_samples import frozen_augmentation_text
from graphsplit.caching.loader.samples import SampleChanges, loader_samples, merge, record_samples
from graphsplit.caching.store import file_writes, regular_files
from graphsplit.caching.store.durability import restarted_since
from graphsplit.caching.store.record_files import (
    read_constants_progress,
    read_manifest,
    read_resume_header,
    read_shard_progress,
    write_manifest,
    write_resume_header,
)
from graphsplit.caching.write.own_files import is_progress_record, refuse_foreign_manifest
from graphsplit.errors import (
    CacheError,
    CorruptCacheError,
    Fix,
    ManifestError,
    Remedy,
    StaleCacheError,
    TornFileError,
    user_error,
)
from graphsplit.signatures.defaults import batch_input_names
from graphsplit.units import human_bytes

__all__ = ["Decision", "decide", "remove_progress"]

Read = TypeVar("Read")


@dataclass(frozen=True)
class Decision:
    """The main process's decision, sent to every process (see the module glossary)."""

    header: CacheHeader
    finished: Mapping[int, ShardProgress] = field(default_factory=dict)
    complete: Manifest | None = None


def decide(
    folder: Path,
    split: Any,
    source: BatchSource,
    current: Fingerprint,
    *,
    storage_dtype: str | None,
    shard_bytes: int,
    overwrite: bool,
    durable: bool = True,
) -> Decision:
    """Decide what to do with ``folder``; record the header of a run that writes anything
    (fsync'd unless ``durable=False``).

    Raises:
        StaleCacheError: the folder holds another cache (complete or not) and ``overwrite`` is
            false, or holds another tool's ``manifest.json`` (whatever ``overwrite`` says);
            CorruptCacheError: a complete cache's file is missing, or (restarted) its
            checksum differs; CacheError: the disk lacks room, or the loader yields nothing.
    """
    refuse_foreign_manifest(folder)
    file_writes.remove_temporary_files(folder, folder / PARTIAL_DIR)
    if source.num_batches == 0:
        raise empty_loader_error()
    if regular_files.exists(folder / MANIFEST_FILE):
        complete = _complete_cache(folder, split, source, current, storage_dtype, overwrite)
        if complete is not None:
            return Decision(header=complete.header, complete=complete)
    header = _resumable_header(folder, split, current, storage_dtype, shard_bytes, overwrite)
    if header is None:
        header = _new_header(split, source, current, storage_dtype, shard_bytes)
    # Finished shards of an interrupted run: their records and files must agree, and the
    # loader must still yield the same samples (order, keys and inputs) for them.
    finished = _finished_shards(folder, header)
    source.refuse_reordered_resume(finished, header.layout.batches_per_shard)
    finished = _same_samples(folder, source, header, finished, overwrite)
    _refuse_without_room(folder, header, source, finished)
    write_resume_header(folder, header, durable=durable)
    return Decision(header=header, finished=finished)


def _complete_cache(
    folder: Path,
    split: Any,
    source: BatchSource,
    current: Fingerprint,
    storage: str | None,
    overwrite: bool,
) -> Manifest | None:
    """The manifest of a complete cache to keep as it is, or None to rebuild it."""
    manifest = _read_or_discard(read_manifest, folder, overwrite)
    if manifest is None:
        return None
    current = in_terms_of(current, manifest.header.fingerprint, split)
    reasons = _header_differences(manifest.header, current, storage, _paired(split))
    if reasons and not overwrite:
        raise user_error(
            StaleCacheError,
            f"the folder {folder} holds a graphsplit cache made differently: {reasons}.",
            fix=Fix(
                "pass {remedy} to replace it, or choose another path",
                Remedy.OVERWRITE,
            ),
        )
    if overwrite:
        _remove_cache_files(folder)
        return None
    warn_about_versions(manifest.header.fingerprint, current, folder, stacklevel=6)
    if source.num_samples is not None and source.num_samples != manifest.num_samples:
        raise user_error(
            StaleCacheError,
            f"the cache at {folder} holds {manifest.num_samples} samples but the loader yields "
            f"{source.num_samples}: samples were added or removed since it was written.",
            fix=Fix(
                "pass {remedy} to rebuild it",
                Remedy.OVERWRITE,
            ),
        )
    _refuse_missing_files(folder, manifest)
    if restarted_since(manifest):
        manifest = _checksummed_after_restart(folder, manifest)
    per_shard = manifest.header.layout.batches_per_shard
    now = loader_samples(source, lambda shard: True, per_shard, manifest.header.inputs)
    changes = SampleChanges.between(
        (row for shard in manifest.shards for row in record_samples(shard)),
        (row for shard in sorted(now) for row in now[shard]),
    )
    if not changes.empty:
        why, fix = ".", "pass {remedy} to rebuild it, or choose another path"
        if source.random_fields:  # a dataset that augments at random differs on every read
            why = (
                f"; {frozen_augmentation_text(source)}, so its inputs differ on every read and "
                "a finished cache cannot be checked against them."
            )
            fix = (
                "train from the finished cache without calling cache() again "
                "(graphsplit.CachedDataset(path, split)), or pass {remedy} to draw new ones"
            )
        raise user_error(
            StaleCacheError,
            f"the cache at {folder} was made from other data than the loader yields now: "
            f"{changes}{why}",
            fix=Fix(fix, Remedy.OVERWRITE),
        )
    remove_progress(folder)  # left over if a run stopped right after writing the manifest
    return manifest


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
        header = _read_or_discard(read_resume_header, folder, overwrite)
    except TornFileError as error:
        # A header cut short by a power cut (graphsplit 0.1 did not fsync it): start from this
        # call's header; the finished shards whose records, files and samples agree are kept.
        warnings.warn(
            f"{error.args[0].splitlines()[0]}; graphsplit resumes the cache at {folder} from "
            "the finished shards that verify",
            stacklevel=6,
        )
        return None
    if header is None:
        return None
    current = in_terms_of(current, header.fingerprint, split)
    reasons = [_header_differences(header, current, storage, _paired(split))]
    if header.layout.shard_bytes != shard_bytes:
        reasons.append(f"it used shard_bytes={header.layout.shard_bytes}")
    if header.inputs != batch_input_names(split):
        reasons.append(f"its stage 1 took the inputs {list(header.inputs)}")
    described = "; ".join(reason for reason in reasons if reason)
    if not described:
        warn_about_versions(header.fingerprint, current, folder, stacklevel=6)
        return header
    if overwrite:
        _remove_cache_files(folder)
        return None
    raise user_error(
        StaleCacheError,
        f"the folder {folder} holds an unfinished cache started differently: {described}.",
        fix=Fix(
            "rerun with the same split and options to finish it, or pass {remedy} to discard it",
            Remedy.OVERWRITE,
        ),
    )


def _read_or_discard(
    read: Callable[[Path], Read | None], folder: Path, overwrite: bool
) -> Read | None:
    """``read(folder)``; a malformed file raises, or with ``overwrite`` is deleted along with
    the rest of graphsplit's files (None: start afresh)."""
    try:
        return read(folder)
    except ManifestError:
        if not overwrite:
            raise
        _remove_cache_files(folder)
        return None


def _new_header(
    split: Any, source: BatchSource, current: Fingerprint, storage: str | None, shard_bytes: int
) -> CacheHeader:
    batch_size = source.batch_size()
    header = CacheHeader(
        fingerprint=current,
        inputs=batch_input_names(split),
        boundary=tuple(split.boundary.values()),
        storage_dtype=storage,
        layout=ShardLayout(batches_per_shard=1, batch_size=batch_size, shard_bytes=shard_bytes),
        paired_rows=getattr(split, "paired_rows", None),
    )
    batch_bytes = max(1, (batch_size or 1) * _stored_bytes_per_sample(header))
    layout = ShardLayout(max(1, shard_bytes // batch_bytes), batch_size, shard_bytes)
    return dataclasses.replace(header, layout=layout)


def _header_differences(
    header: CacheHeader, current: Fingerprint, storage: str | None, paired: Any = None
) -> str:
    """What binds ``header``'s cache to another split than ``current``'s; ``paired``: the
    split's ``paired_rows``. A cache written before the split was known to pair rows lacks
    its stage-1 batches (stage 2 would read rows regrouped): it must be rebuilt. A paired cache
    of a split that no longer pairs rows reads whole batches, which is right either way."""
    reasons = [describe_differences(header.fingerprint, current, parts=BINDING_PARTS)]
    if paired is not None and header.paired_rows is None:
        reasons.append(
            f"{paired.describe()}, but the cache was written without recording its stage-1 "
            "batches, so stage 2 could not read them whole"
        )
    if header.storage_dtype != storage:
        reasons.append(
            f"it stores {header.storage_dtype or 'losslessly'}, this call asks for "
            f"{storage or 'lossless storage'}"
        )
    return "; ".join(reason for reason in reasons if reason)


def _paired(split: Any) -> Any:
    """The split's ``paired_rows`` (None: an ordinary split, or a split-like object without it)."""
    return getattr(split, "paired_rows", None)


def _finished_shards(folder: Path, header: CacheHeader) -> dict[int, ShardProgress]:
    """The shards of an interrupted run whose record and file (checksum included) agree."""
    candidates = []
    for name in file_writes.list_files(folder / PARTIAL_DIR):
        match = SHARD_PROGRESS_PATTERN.fullmatch(name)
        progress = match and read_shard_progress(folder, int(match.group(1)), header)
        if progress:
            candidates.append((int(match.group(1)), progress))

    def intact(progress: ShardProgress) -> bool:
        record = progress.shard
        return regular_files.file_matches(
            folder / record.file, size=record.bytes, checksum=record.checksum
        )

    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:  # hashing releases the GIL
        verdicts = list(pool.map(intact, [progress for _, progress in candidates]))
    finished = {index: progress for (index, progress), ok in zip(candidates, verdicts) if ok}
    if header.constant_specs and 0 in finished:
        constants = read_constants_progress(folder, header)
        record = constants and constants.constants
        if not record or not regular_files.file_matches(
            folder / CONSTANTS_FILE, size=record.bytes, checksum=record.checksum
        ):
            del finished[0]  # shard 0's first batch also writes the constants: redo it
    return finished


def _same_samples(
    folder: Path,
    source: BatchSource,
    header: CacheHeader,
    finished: dict[int, ShardProgress],
    overwrite: bool,
) -> dict[int, ShardProgress]:
    """The finished shards whose samples the loader still yields unchanged; a changed shard
    is refused, or with ``overwrite`` redone."""
    if not finished:
        return finished
    per_shard = header.layout.batches_per_shard
    now = loader_samples(source, finished.__contains__, per_shard, header.inputs)
    changes = {}
    for shard, progress in finished.items():
        change = SampleChanges.between(record_samples(progress.shard), now.get(shard, []))
        if not change.empty:
            changes[shard] = change
    if changes and not overwrite:
        raise user_error(
            StaleCacheError,
            f"the unfinished cache at {folder} was started from other data than the loader yields "
            f"now: {merge(changes)}, in finished shard(s) {sorted(changes)}.",
            fix=Fix(
                "rerun with the data the run started with, or pass {remedy} to redo the changed "
                "shards",
                Remedy.OVERWRITE,
            ),
        )
    return {shard: progress for shard, progress in finished.items() if shard not in changes}


def _refuse_without_room(
    folder: Path, header: CacheHeader, source: BatchSource, finished: Mapping[int, ShardProgress]
) -> None:
    if source.num_samples is None:
        return  # an iterable without a length: ENOSPC is reported when it happens
    remaining = source.num_samples - sum(len(done.shard.keys) for done in finished.values())
    per_sample = _stored_bytes_per_sample(header) + 64 * len(header.sample_specs) + 256
    needed = max(0, remaining) * per_sample
    free = file_writes.free_bytes(folder)
    if free is not None and needed > free:
        hint = ""
        if header.storage_dtype is None and any(
            spec.dtype.is_floating_point and spec.dtype.itemsize > 2 for spec in header.sample_specs
        ):
            hint = f", or store in lower precision ({Remedy.STORE_BFLOAT16.words()})"
        raise user_error(
            CacheError,
            f"not enough disk space for the cache at {folder}: it needs about "
            f"{human_bytes(needed)} ({remaining} samples x {human_bytes(per_sample)}) but only "
            f"{human_bytes(free)} are free there.",
            fix=Fix(f"free some space or choose another path{hint}"),
        )


def _stored_bytes_per_sample(header: CacheHeader) -> int:
    total = 0
    for spec in header.sample_specs:
        ratio = header.stored_dtype(spec).itemsize / max(1, spec.dtype.itemsize)
        total += math.ceil(spec.bytes_per_sample * ratio)
    return total


def _refuse_missing_files(folder: Path, manifest: Manifest) -> None:
    records = [*manifest.shards, *constants_records(manifest)]
    for record in records:
        size = regular_files.regular_size(folder / record.file)
        if size != record.bytes:
            state = "is missing" if size is None else f"has {size} bytes, not {record.bytes}"
            raise user_error(
                CorruptCacheError,
                f"the cache at {folder} is damaged: {record.file} {state}.",
                fix=Fix(
                    "run graphsplit.check_cache(path) for details, or rebuild it with {remedy}",
                    Remedy.OVERWRITE,
                ),
            )


def _checksummed_after_restart(folder: Path, manifest: Manifest) -> Manifest:
    """``manifest`` of a cache written without fsyncs before the machine restarted, once each
    of its files matches its checksum; then the files and the folder are fsync'd and the
    manifest rewritten without ``unsynced``, durably. After a restart the bytes just hashed
    came from the disk and the fsyncs cost little; they make the record true even where they
    did not (a folder copied in since, or a system without a boot id).

    Raises:
        CorruptCacheError: a file's checksum differs (a power cut lost what it held).
    """
    records = [*manifest.shards, *constants_records(manifest)]

    def intact(record: Any) -> bool:
        return regular_files.file_matches(
            folder / record.file, size=record.bytes, checksum=record.checksum
        )

    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:  # hashing releases the GIL
        damaged = [record.file for record, ok in zip(records, pool.map(intact, records)) if not ok]
    if damaged:
        raise user_error(
            CorruptCacheError,
            f"the cache at {folder} was written with durable=False (without fsync) and the machine "
            f"has restarted since; {len(damaged)} of its files no longer match their checksums "
            f"({', '.join(damaged[:5])}): the restart lost bytes that were not yet on the disk.",
            fix=Fix(
                "rebuild it with {remedy} (pass durable=True for a cache that survives a power "
                "cut)",
                Remedy.OVERWRITE,
            ),
        )
    for record in records:
        file_writes.fsync_file(folder / record.file)
    file_writes.fsync_folder(folder)
    durable = dataclasses.replace(manifest, unsynced=None)
    write_manifest(folder, durable)
    return durable


def _remove_cache_files(folder: Path) -> None:
    """Delete the files graphsplit wrote (the manifest first), nothing else in the folder."""
    file_writes.remove(folder / MANIFEST_FILE)
    for name in file_writes.list_files(folder):
        if (
            SHARD_FILE_PATTERN.fullmatch(name)
            or name == CONSTANTS_FILE
            or PLAN_CONSTANTS_PATTERN.fullmatch(name)
            or file_writes.TEMPORARY_FILE.fullmatch(name)
        ):
            file_writes.remove(folder / name)
    remove_progress(folder)


def remove_progress(folder: Path) -> None:
    """Delete graphsplit's records in ``.partial/``, then the folder if that empties it (the
    cache is complete, or discarded); another tool's files there stay."""
    partial = folder / PARTIAL_DIR
    if isinstance(partial, Path) and not file_writes.real_folder(partial, create=False):
        return
    for name in file_writes.list_files(partial):
        if is_progress_record(name) or file_writes.TEMPORARY_FILE.fullmatch(name):
            file_writes.remove(partial / name)
    if isinstance(partial, Path):  # an object store has no empty folders to remove
        with contextlib.suppress(OSError):
            partial.rmdir()
