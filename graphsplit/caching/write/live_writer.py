"""A push-style cache writer: the training loop hands it each batch's boundary as it goes.

:func:`graphsplit.cache` pulls batches from a loader it owns, in the loader's order. A live
cache (:class:`graphsplit.LiveCache`) is written while training: the loop owns the loader
(shuffled, split between processes, resumed from a checkpoint), runs stage 1 on each raw batch
for its own step, and hands the outputs here. The files are those ``cache()`` writes, through
the same pieces (:mod:`~graphsplit.caching.write.shards`' rows, background :class:`ShardWriter`,
constants, progress records; :mod:`~graphsplit.caching.write.folder_decision`'s header checks),
so :class:`~graphsplit.CachedDataset` and :func:`~graphsplit.check_cache` read it unchanged.

Glossary:
    sample identity: a sample is its key, ``batch["key"][row]`` (as in ``cache()``); a live
        cache has no loader positions to number samples by (a shuffled epoch has none that
        mean anything), so a batch without keys is refused.
    known key: a key already in the cache (a finished shard of an interrupted run, or a row
        this run wrote): its row is not written again; its inputs must hash as they did
        (a key seen again with other inputs is an error).
    shard order: rows are written in the order the loop gives them, into shards of about
        ``shard_bytes``; process ``r`` of ``w`` numbers its shards ``r, r + w, r + 2w, ...``
        after every finished shard. ``finish`` renames them to ``0 .. n-1`` (the manifest's
        rule); the header's layout records ``shard_bytes`` only (``batches_per_shard=1``,
        ``batch_size=None``: shards do not follow loader batches).
    resume: after an interruption (an exception, ``kill -9``) the finished shards are kept;
        the rows still in memory are lost. The next live run (or epoch) on the folder skips
        the known keys and writes the others; stage 1 still runs on every batch, since the
        step needs its boundary.

In and out::

    LiveWriter.open(split, folder, *, processes, shard_bytes, storage_dtype, overwrite, durable)
        .add(keys, inputs, outputs, plan)     # one batch's stage-1 outputs (on the CPU or not)
        .finish() -> Manifest                 # every process; the main one writes the manifest
        .abandon()                            # an interruption: keep what is committed
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from graphsplit.caching.format.fingerprint import fingerprint
from graphsplit.caching.format.input_digests import batch_input_digests
from graphsplit.caching.format.layout import (
    LOCK_FILE,
    MANIFEST_FILE,
    PARTIAL_DIR,
    SHARD_FILE_PATTERN,
    SHARD_PROGRESS_PATTERN,
    CacheHeader,
    Manifest,
    ShardLayout,
    ShardProgress,
    shard_file_name,
    shard_progress_name,
)
from graphsplit.caching.store import file_writes, regular_files
from graphsplit.caching.store.durability import unsynced_record
from graphsplit.caching.store.lock import FolderLock
from graphsplit.caching.store.record_files import (
    read_constants_progress,
    read_manifest,
    read_resume_header,
    read_shard_progress,
    write_manifest,
    write_resume_header,
)
from graphsplit.caching.write.cache_run import (
    _add_errors,
    _make_folder,
    _plans_of,
    _refuse_repeated_keys,
)
from graphsplit.caching.write.folder_decision import (
    _finished_shards,
    _header_differences,
    _remove_cache_files,
    remove_progress,
)
from graphsplit.caching.write.live_duplicates import drop_repeated_rows, part_of_paired_batch
from graphsplit.caching.write.plan_constants import PlanConstants
from graphsplit.caching.write.plan_rows import note_plan
from graphsplit.caching.write.processes import Processes
from graphsplit.caching.write.shards import (
    PendingShard,
    ShardWriter,
    _add_rows,
    _digested,
    _note_progress,
    _snapshot,
    _to_storage,
    _write_constants,
)
from graphsplit.errors import CacheError, Fix, Remedy, StaleCacheError, user_error
from graphsplit.signatures.defaults import batch_input_names

__all__ = ["LiveWriter"]


@dataclasses.dataclass(frozen=True)
class _Opening:
    """What the main process found in the folder, sent to every process."""

    header: CacheHeader
    finished: Mapping[int, ShardProgress]
    complete: Manifest | None


class LiveWriter:
    """Writes a cache from the batches a training loop pushes; see the module docstring."""

    def __init__(
        self,
        split: Any,
        folder: Path,
        opening: _Opening,
        processes: Processes,
        lock: FolderLock | None,
        *,
        durable: bool,
    ) -> None:
        self.split = split
        self.folder = folder
        self.header = opening.header
        self.finished = dict(opening.finished)
        self.complete = opening.complete
        self.processes = processes
        self.durable = durable
        self._lock = lock
        # Every known key and its input digest (the finished shards', or the complete cache's).
        records = (
            self.complete.shards
            if self.complete is not None
            else [progress.shard for progress in self.finished.values()]
        )
        # A row written by this run is known by its batch's digests and its row there.
        self.known: dict[str, str | tuple[Future[list[str]], int]] = {
            key: digest
            for record in records
            for key, digest in zip(record.keys, record.input_sha256)
        }
        self._checks: list[tuple[list[tuple[int, str, Any]], Future[list[str]]]] = []
        self._writer = ShardWriter(folder, durable=durable)
        self._digester = ThreadPoolExecutor(1, thread_name_prefix="graphsplit-digest")
        self._pending: PendingShard | None = None
        self._constants = PlanConstants(folder, self.header, split, self.finished, durable=durable)
        self._write_constants = processes.is_main and 0 not in self.finished
        self._next_index = _first_index(self.finished, processes)
        self._position = 0
        self.written_rows = 0

    @classmethod
    def open(
        cls,
        split: Any,
        folder: Path,
        *,
        processes: Processes,
        shard_bytes: int,
        storage_dtype: str | None,
        overwrite: bool,
        durable: bool,
    ) -> LiveWriter:
        """Lock the folder (main process) and decide: complete, resume, or start afresh."""
        current = fingerprint(split)
        processes.refuse_other_fingerprints(current)
        lock = FolderLock(folder / LOCK_FILE, durable=durable) if processes.is_main else None

        def decide() -> _Opening:
            _make_folder(folder)
            assert lock is not None
            lock.acquire()
            try:
                return _decide(
                    folder, split, current, storage_dtype, shard_bytes, overwrite, durable
                )
            except BaseException:
                lock.release()
                raise

        opening = processes.on_main(decide)
        return cls(split, folder, opening, processes, lock, durable=durable)

    # -- adding rows ----------------------------------------------------------------------------
    def add(
        self,
        keys: Sequence[str],
        inputs: Mapping[str, Any],
        outputs: Mapping[str, torch.Tensor],
        plan: Any,
    ) -> None:
        """Store the rows of the batch's new keys; check the known keys' inputs (later)."""
        size = len(keys)
        names = self.header.inputs
        digesting = self._digester.submit(batch_input_digests, _snapshot(inputs), names, size)
        fresh = [row for row, key in enumerate(keys) if key not in self.known]
        seen = [(row, key, self.known[key]) for row, key in enumerate(keys) if key in self.known]
        if seen:
            self._checks.append((seen, digesting))
        if len(set(keys)) != size:
            raise user_error(
                CacheError,
                f"the batch names a sample key twice: {sorted(keys)}.",
                fix=Fix("give every sample of the dataset a unique 'key'"),
            )
        if self.complete is not None or not fresh:
            return
        if len(fresh) < size and self.header.paired_rows is not None:
            raise part_of_paired_batch(self.folder, self.header, size - len(fresh), size)
        for row in fresh:
            self.known[keys[row]] = (digesting, row)
        # The rows wait for their shard's save on another thread while stage 2 runs on the
        # same tensors: the writer keeps copies that nothing the step does can change.
        outputs = {
            name: value.detach().clone() if value.device.type == "cpu" else value
            for name, value in outputs.items()
        }
        stored, errors = _to_storage(outputs, self.header)
        own_errors = self._constants.handle(
            stored,
            errors,
            0 if self._write_constants else 1,
            plan,
            lambda values, errs: _write_constants(self.folder, values, errs, durable=self.durable),
        )
        self._write_constants = False
        if len(fresh) < size:
            stored = _rows(stored, self.header, fresh)
            digesting = self._digester.submit(_chosen, digesting, fresh)
        # A shard holds the whole batches that fit in shard_bytes (at least one), as in cache().
        incoming = sum(stored[spec.name].nbytes for spec in self.header.sample_specs)
        limit = self.header.layout.shard_bytes
        if self._pending is not None and self._pending.nbytes + incoming > limit:
            self._submit()
        pending = self._pending or PendingShard(self._next_index)
        self._pending = pending
        positions = range(self._position, self._position + len(fresh))
        self._position += len(fresh)
        pending.digesting.append(digesting)
        _add_rows(pending, self.header, stored, errors, [keys[row] for row in fresh], positions)
        note_plan(pending, self.split, plan, len(fresh), self._constants.record)
        _add_errors(pending.max_abs_error, own_errors)
        self.written_rows += len(fresh)
        if pending.nbytes >= limit:
            self._submit()

    def commit(self) -> None:
        """Save the rows held in memory as a shard now and wait until every shard of this run
        is committed: a run resumed later finds them (a trainer's checkpoint covers them)."""
        self._submit()
        self._writer.wait()

    def _submit(self) -> None:
        if self._pending is not None:
            self._writer.submit(_digested(self._pending))
            self._pending = None
            self._next_index += self.processes.world
        self._check_known()

    def _check_known(self) -> None:
        """Refuse a known key whose inputs hash otherwise than when its row was written."""
        for seen, digesting in self._checks:
            digests = digesting.result()
            for row, key, expected in seen:
                if isinstance(expected, tuple):
                    written, written_row = expected
                    expected = written.result()[written_row]
                if digests[row] != expected:
                    raise user_error(
                        StaleCacheError,
                        f"the sample key {key!r} came again with other inputs than the cache at "
                        f"{self.folder} holds for it.",
                        fix=Fix(
                            "give every sample a unique 'key' (and keep its data unchanged), or "
                            "pass {remedy} to start the cache afresh",
                            Remedy.OVERWRITE,
                        ),
                    )
        self._checks = []

    # -- ending -------------------------------------------------------------------------------
    def finish(self) -> Manifest:
        """Write the last shard, then (main process) rename the shards into order and write the
        manifest; every process returns it."""
        try:
            if self.complete is None:
                self.processes.everywhere(self._flush)
                manifest = self.processes.on_main(self._publish)
            else:
                self.processes.everywhere(self._check_known)
                manifest = self.complete
        except BaseException:
            self.abandon()
            raise
        self._release()
        return manifest

    def abandon(self) -> None:
        """Stop after an interruption: wait for the shards being saved (they are kept, and a
        later run resumes from them), drop the rows still in memory, release the folder."""
        self._pending = None
        self._writer.close(cancel=True)
        self._release()

    def _flush(self) -> None:
        self._submit()
        self._writer.close()

    def _release(self) -> None:
        self._digester.shutdown(wait=True, cancel_futures=True)
        if self._lock is not None and self._lock.held:
            self._lock.release()

    def _publish(self) -> Manifest:
        """Number the shards ``0 .. n-1`` (renaming file and record), write the manifest."""
        records = _progress_records(self.folder, self.header)
        if not records:
            raise user_error(
                CacheError,
                f"no sample was written to the live cache at {self.folder}; there is nothing to "
                "finish.",
                fix=Fix("call LiveCache.step on at least one batch before finishing"),
            )
        records = drop_repeated_rows(self.folder, self.header, records, durable=self.durable)
        shards = [
            _renumbered(self.folder, progress, index) for index, (_, progress) in enumerate(records)
        ]
        _refuse_repeated_keys(self.folder, [progress.shard for progress in shards])
        constants = None
        errors: dict[str, float] = {}
        for progress in shards:
            _add_errors(errors, progress.max_abs_error)
        if self.header.constant_specs:
            written = read_constants_progress(self.folder, self.header)
            if written is None:
                raise user_error(
                    CacheError,
                    f"the constants of the live cache at {self.folder} were not written.",
                    fix=Fix("rerun the epoch: the finished shards are kept"),
                )
            constants = written.constants
            _add_errors(errors, written.max_abs_error)
        plans: dict[str, Any] = {}
        for progress in shards:
            plans.update(progress.plans or {})
        manifest = Manifest(
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            unsynced=unsynced_record(self.folder, durable=self.durable),
            header=self.header,
            num_samples=sum(len(progress.shard.keys) for progress in shards),
            max_abs_error={
                s.name: errors[s.name] for s in self.header.boundary if s.name in errors
            },
            constants=constants,
            shards=tuple(progress.shard for progress in shards),
            **_plans_of(self.split, plans),
        )
        if self.durable:
            for index in self.finished:  # an earlier run may have written them without fsync
                file_writes.fsync_file(self.folder / shard_file_name(index))
            file_writes.fsync_folder(self.folder)
        write_manifest(self.folder, manifest, durable=self.durable)
        remove_progress(self.folder)
        return manifest


def _decide(
    folder: Path,
    split: Any,
    current: Any,
    storage: str | None,
    shard_bytes: int,
    overwrite: bool,
    durable: bool,
) -> _Opening:
    """A complete cache of this split is kept; an unfinished one resumes; another is refused
    (or with ``overwrite`` removed)."""
    file_writes.remove_temporary_files(folder, folder / PARTIAL_DIR)
    header = _header(split, current, storage, shard_bytes)
    if regular_files.exists(folder / MANIFEST_FILE):
        manifest = read_manifest(folder)
        reasons = _header_differences(manifest.header, current, storage, header.paired_rows)
        if not reasons:
            return _Opening(manifest.header, {}, manifest)
        _refuse_or_remove(
            folder, f"holds a graphsplit cache made differently: {reasons}", overwrite
        )
    started = read_resume_header(folder)
    if started is not None:
        reasons = _header_differences(started, current, storage, header.paired_rows)
        if started.layout.shard_bytes != shard_bytes:
            reasons = "; ".join(
                filter(None, [reasons, f"it used shard_bytes={started.layout.shard_bytes}"])
            )
        if not reasons:
            header = started
        else:
            what = f"holds an unfinished cache started differently: {reasons}"
            _refuse_or_remove(folder, what, overwrite)
    finished = _finished_shards(folder, header) if started is not None and header is started else {}
    _remove_unfinished(folder, finished)
    write_resume_header(folder, header, durable=durable)
    return _Opening(header, finished, None)


def _remove_unfinished(folder: Path, finished: Mapping[int, ShardProgress]) -> None:
    """Delete the shards (and records) an interrupted run left that did not verify: this
    run numbers its shards after the finished ones, and publishes every record it finds."""
    for name in file_writes.list_files(folder):
        match = SHARD_FILE_PATTERN.fullmatch(name)
        if match and int(match.group(1)) not in finished:
            file_writes.remove(folder / name)
    for name in file_writes.list_files(folder / PARTIAL_DIR):
        match = SHARD_PROGRESS_PATTERN.fullmatch(name)
        if match and int(match.group(1)) not in finished:
            file_writes.remove(folder / PARTIAL_DIR / name)


def _refuse_or_remove(folder: Path, what: str, overwrite: bool) -> None:
    if not overwrite:
        raise user_error(
            StaleCacheError,
            f"the folder {folder} {what}.",
            fix=Fix("pass {remedy} to replace it, or choose another path", Remedy.OVERWRITE),
        )
    _remove_cache_files(folder)


def _header(split: Any, current: Any, storage: str | None, shard_bytes: int) -> CacheHeader:
    return CacheHeader(
        fingerprint=current,
        inputs=batch_input_names(split),
        boundary=tuple(split.boundary.values()),
        storage_dtype=storage,
        layout=ShardLayout(batches_per_shard=1, batch_size=None, shard_bytes=shard_bytes),
        paired_rows=getattr(split, "paired_rows", None),
    )


def _first_index(finished: Mapping[int, ShardProgress], processes: Processes) -> int:
    """This process's first shard number: its residue, after every finished shard."""
    start = max(finished, default=-1) + 1
    offset = (processes.rank - start) % processes.world
    return start + offset


def _progress_records(folder: Path, header: CacheHeader) -> list[tuple[int, ShardProgress]]:
    """Every shard recorded in ``.partial/`` whose file is there, by index."""
    found = []
    for name in file_writes.list_files(folder / PARTIAL_DIR):
        match = SHARD_PROGRESS_PATTERN.fullmatch(name)
        progress = match and read_shard_progress(folder, int(match.group(1)), header)
        if progress and regular_files.regular_size(folder / progress.shard.file) is not None:
            found.append((int(match.group(1)), progress))
    return sorted(found, key=lambda pair: pair[0])


def _renumbered(folder: Path, progress: ShardProgress, index: int) -> ShardProgress:
    """Shard ``progress`` as shard ``index``: file renamed, record rewritten (an index never
    grows, so the target name is free: every shard before it has already moved down)."""
    old = progress.shard.file
    new = shard_file_name(index)
    if old == new:
        return progress
    os.replace(folder / old, folder / new)
    renamed = dataclasses.replace(progress, shard=dataclasses.replace(progress.shard, file=new))
    _note_progress(folder, renamed)
    old_record = folder / PARTIAL_DIR / Path(old).with_suffix(".json").name
    if old_record.name != shard_progress_name(index):
        file_writes.remove(old_record)
    return renamed


def _rows(
    stored: Mapping[str, torch.Tensor], header: CacheHeader, rows: list[int]
) -> dict[str, torch.Tensor]:
    """The chosen rows of each per-sample tensor (constants as they are)."""
    chosen = torch.tensor(rows)
    picked = dict(stored)
    for spec in header.sample_specs:
        assert spec.batch_dim is not None
        picked[spec.name] = stored[spec.name].index_select(spec.batch_dim, chosen)
    return picked


def _chosen(digesting: Future[list[str]], rows: list[int]) -> list[str]:
    digests = digesting.result()
    return [digests[row] for row in rows]
