"""Audit a cache folder: is every file there, whole, and holding what the manifest lists?

Glossary:
    problem: one damaged file of a cache (missing, another size, another checksum, tensors other
        than the manifest lists) and the samples it holds; the other files still read.
    tensor problem: a shard whose safetensors header names other tensors, shapes or dtypes
        than the manifest's rows (read from the header alone, no tensor data; compared by
        :func:`~graphsplit.caching.format.shard_header.shard_tensors_problem`).

Every file is checked through one open of it (:func:`open_problem`): its size, its
checksum and its header (the one strict parser every reader uses) come from the same
memory map, or, on an object store, the same open object pinned to the version (ETag) the
manifest recorded.

In and out::

    check_cache(path) -> CacheReport                     # every checksum, size and tensor header
    open_problem(path, record, manifest=None, *, checksum) -> (handle | None, problem | None)
    file_problem(folder, record, *, checksum) -> str | None   # size and checksum only
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphsplit.caching.format.checksums import algorithm_of
from graphsplit.caching.format.layout import (
    CONSTANTS_FILE,
    MANIFEST_FILE,
    FileRecord,
    Manifest,
    ShardRecord,
    constants_records,
)
from graphsplit.caching.format.records import REBUILD
from graphsplit.caching.format.shard_header import shard_tensors_problem
from graphsplit.caching.read.collation import sample_signatures
from graphsplit.caching.store import regular_files
from graphsplit.caching.store.durability import restart_cause
from graphsplit.caching.store.mapped import open_mapped
from graphsplit.caching.store.ranged import open_ranged
from graphsplit.caching.store.record_files import read_manifest
from graphsplit.caching.store.remote import RemotePath, location
from graphsplit.errors import (
    Fix,
    GraphsplitError,
    ManifestError,
    Remedy,
    UnsafeFileError,
)
from graphsplit.units import some_keys

__all__ = [
    "CacheProblem",
    "CacheReport",
    "check_cache",
    "file_problem",
    "open_problem",
]


@dataclass(frozen=True)
class CacheProblem:
    """One damaged file of a cache and the samples it affects."""

    file: str
    reason: str
    keys: tuple[str, ...] = ()

    def __str__(self) -> str:
        affected = f" ({len(self.keys)} samples: {some_keys(self.keys)})" if self.keys else ""
        return f"{self.file}: {self.reason}{affected}"


@dataclass(frozen=True)
class CacheReport:
    """What :func:`check_cache` found; ``ok`` when every file is intact."""

    path: Path | RemotePath
    num_samples: int
    num_shards: int
    checked_bytes: int
    problems: tuple[CacheProblem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_keys(self) -> list[str]:
        """The keys of every sample that cannot be read."""
        return [key for problem in self.problems for key in problem.keys]

    def __str__(self) -> str:
        if self.ok:
            return (
                f"cache {self.path}: OK ({self.num_samples} samples, {self.num_shards} shards, "
                f"{self.checked_bytes:,} bytes verified)"
            )
        lines = [
            f"cache {self.path}: {len(self.problems)} problem(s), "
            f"{len(self.damaged_keys)} of {self.num_samples} samples unreadable"
        ]
        lines += [f"  {problem}" for problem in self.problems]
        # A report, not an error: its one fix line reads as user_error writes them.
        lines.append(Fix(REBUILD, Remedy.OVERWRITE).line())
        return "\n".join(lines)


def check_cache(path: str | os.PathLike[str]) -> CacheReport:
    """Verify a cache folder: the manifest, and every file's size, checksum and tensor header.

    Reads every byte of the cache once. Problems are collected, not raised, so one call
    lists every damaged shard and the samples it holds. ``path`` may be a URL of any fsspec
    filesystem (``s3://bucket/cache``): every object is then streamed once, and each shard's
    header read by ranges.

    Raises:
        UnsupportedStorageError: a URL fsspec cannot open; StorageError: the store failed.

    Example:
        >>> report = check_cache(path)  # doctest: +SKIP
        >>> report.ok, report.damaged_keys  # doctest: +SKIP
        (True, [])
    """
    folder = location(path)
    try:
        manifest = read_manifest(folder)
    except ManifestError as error:
        return CacheReport(folder, 0, 0, 0, (CacheProblem(MANIFEST_FILE, str(error)),))
    problems: list[CacheProblem] = []
    checked = 0
    cause = restart_cause(manifest)  # a cache written without fsync, before a restart
    for record in constants_records(manifest):  # the cache's, then each plan's own
        handle, problem = open_problem(folder / record.file, record, checksum=True)
        if problem is None:
            problem = _constants_problem(handle, manifest)
        if problem is not None:
            needs = "every batch" if record.file == CONSTANTS_FILE else "every batch of its plan"
            reason = f"{problem}{cause} ({needs} needs it)"
            problems.append(CacheProblem(record.file, reason, _plan_keys(manifest, record)))
        else:
            checked += record.bytes
    for record in manifest.shards:
        _, problem = open_problem(folder / record.file, record, manifest, checksum=True)
        if problem is None:
            checked += record.bytes
        else:
            problems.append(CacheProblem(record.file, problem + cause, record.keys))
    return CacheReport(folder, manifest.num_samples, len(manifest.shards), checked, tuple(problems))


def file_problem(folder: Path | RemotePath, record: FileRecord, *, checksum: bool) -> str | None:
    """What is wrong with a recorded file (missing, not a regular file, another size or
    checksum), or None."""
    path = folder / record.file
    try:
        size = regular_files.regular_size(path)
        if size is None:
            return "the file is missing"
        if size != record.bytes:
            return f"it has {size:,} bytes, the manifest records {record.bytes:,}"
        if checksum:
            algorithm = algorithm_of(record.checksum)
            if regular_files.checksum_file(path, algorithm) != record.checksum:
                return f"its {algorithm} checksum differs from the manifest's (the bytes changed)"
    except UnsafeFileError as error:
        return "it " + _first_clause(error).removeprefix(f"{path} ")
    except OSError as error:
        return f"the file cannot be read ({error.strerror or error})"
    return None


def open_problem(
    path: Path | RemotePath,
    record: FileRecord,
    manifest: Manifest | None = None,
    *,
    checksum: bool,
) -> tuple[Any, str | None]:
    """Open a file of a cache once: check its size, its checksum (when ``checksum``) and its
    header through that one open, and, given the ``manifest`` and a shard's record, that it
    holds the manifest's rows. Its handle (a :class:`MappedShard`, or a :class:`RangedShard`
    on an object store), or a problem.

    Raises:
        StorageError: the store failed a request.
    """
    if isinstance(path, RemotePath):
        problem = file_problem(path.parent, record, checksum=False)  # a folder in its place
        if problem is not None:
            return None, problem
        handle = open_ranged(path, record, checksum=checksum)
    else:
        handle = open_mapped(path, record, checksum=checksum)
    if isinstance(handle, str):
        return None, handle
    if manifest is not None and isinstance(record, ShardRecord):
        problem = shard_tensors_problem(handle.table, record, manifest)
        if problem is not None:
            return None, problem
    return handle, None


def _plan_keys(manifest: Manifest, record: FileRecord) -> tuple[str, ...]:
    """The samples of the plan whose own constants file is ``record`` (none for the cache's)."""
    owner = [key for key, plan in (manifest.plans or {}).items() if plan.constants == record]
    if not owner:
        return ()
    keys = [key for shard in manifest.shards for key in shard.keys]
    return tuple(k for k, plan in zip(keys, sample_signatures(manifest)) if plan == owner[0])


def _constants_problem(handle: Any, manifest: Manifest) -> str | None:
    names = set(handle.keys())
    wanted = {spec.name for spec in manifest.header.constant_specs}
    if names != wanted:
        return f"it holds {sorted(names)}, the manifest lists {sorted(wanted)}"
    return None


def _first_clause(error: GraphsplitError) -> str:
    """What went wrong, in the words of the error's reason up to its first ";" (a problem
    names the file; the fix is said once, by the report)."""
    return (error.reason or str(error)).split(";")[0]
