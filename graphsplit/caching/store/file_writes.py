"""Every byte graphsplit writes in a cache folder goes through here, crash-safe.

Reading opens only regular files inside the folder: :mod:`graphsplit.caching.store.regular_files`.

Glossary:
    temporary file: ``.graphsplit-{name}.{pid}-{token}.tmp`` next to the file it becomes
        (``token`` random per process), created exclusively (never through a planted symlink);
        a run that dies leaves only those behind, and the next run deletes them
        (:func:`remove_temporary_files`). The name is unmistakable on purpose: a file such as
        ``.env.tmp`` or ``.notes.tmp`` is another tool's and is never touched.
    commit: fsync a finished temporary file, then rename it over its final name, so a reader
        sees the old file or the whole new one, never a part. The checksum of a file graphsplit
        wrote (:mod:`graphsplit.caching.format.checksums`) is computed from the bytes in memory as
        they are written, each piece right after the write that read it, so nothing is read
        back.
    durable: fsync'd, file and folder, so it survives a power cut. Every file is fsync'd before
        anything relies on it; the folder once before the manifest names its files. Writes
        with ``durable=False`` skip the fsyncs and are still atomic: a reader (or a process
        killed meanwhile) sees the old file or the whole new one, until the machine restarts
        (see :mod:`graphsplit.caching.store.durability`).
    real folder: a folder, not a symlink to one (nor a file): graphsplit writes only there.
    no room: ENOSPC, EDQUOT or EFBIG while writing; always a :class:`DiskFullError` saying what
        was needed and that the run resumes. The half-written temporary file is deleted.

In and out::

    write_atomically(path, data, *, durable=True)     # atomic, no room -> DiskFullError
    save_tensors(tensors, path, metadata) -> checksum # safetensors, to path's temporary file
    commit_file(temporary, path, *, checksum=None, durable=True) -> (bytes, checksum)
                                                      # checksum None: read the file
    real_folder(path, *, create, durable=True) -> bool    # no symlinked folders either
    fsync_file(path)    fsync_folder(folder)          # no-ops on an object store
    free_bytes(folder) -> int | None    no_room(folder, name, needed)   # -> DiskFullError
    list_files(folder) -> names    remove(path)    remove_temporary_files(*folders)
    rewrite_descriptor(path, descriptor, data, *, durable=True)     # the lock file, in place

Each of these also takes a :class:`~graphsplit.caching.store.remote.RemotePath` (a cache on an
fsspec filesystem) and does the same there with whole-object puts (see
:mod:`graphsplit.caching.store.remote`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from graphsplit.caching.format.checksums import ALGORITHM, Running
from graphsplit.caching.format.tensor_file import (
    SAFETENSORS_DTYPES,
    TensorBytes,
    safetensors_dtype,
    serialise,
)
from graphsplit.caching.store import remote
from graphsplit.caching.store.regular_files import (
    CLOEXEC,
    NOFOLLOW,
    checksum_descriptor,
    checksum_file,
    open_regular,
    unsafe_file_error,
)
from graphsplit.caching.store.remote import RemotePath, nothing, or_remote
from graphsplit.errors import DiskFullError, Fix, user_error
from graphsplit.units import human_bytes

__all__ = [
    "FILE_MODE",
    "SAFETENSORS_DTYPES",
    "TEMPORARY_FILE",
    "commit_file",
    "free_bytes",
    "fsync_file",
    "fsync_folder",
    "list_files",
    "no_room",
    "real_folder",
    "remove",
    "remove_temporary_files",
    "rewrite_descriptor",
    "safetensors_dtype",
    "save_tensors",
    "temporary_path",
    "write_atomically",
]

TEMPORARY_FILE = re.compile(r"\.graphsplit-.+\.[0-9]+-[0-9a-f]{16}\.tmp")
_TOKEN = secrets.token_hex(8)  # with the PID: one name per process (a fork has its own PID)
# Every file, shards and manifest alike: read and write for all, less the umask (0o022 gives
# 0o644, 0o002 gives 0o664 for a group-shared cache).
FILE_MODE = 0o666
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# ------------------------------------------------------------------------------------ writing


@or_remote(remote.staging_path)
def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before it is committed: ``.graphsplit-{name}.{pid}-{token}.tmp``
    in the same folder, the same name for every call in this process (for a remote ``path``, a
    local staging file)."""
    return path.with_name(f".graphsplit-{path.name}.{os.getpid()}-{_TOKEN}.tmp")


def _put_remote(path: RemotePath, data: bytes, *, durable: bool = True) -> None:
    remote.put_bytes(path, data)  # an object store's put is atomic and durable either way


@or_remote(_put_remote)
def write_atomically(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The bytes go to a temporary name in the same folder, are fsync'd and renamed over
    ``path``; the folder is fsync'd after, so both survive a power cut. ``durable=False``
    skips both fsyncs, for files that are only hints checked before use (progress records:
    after a power cut one may be missing or empty, which means redoing its shard); each
    fsync there forced a journal commit that stalled the shard being written meanwhile.

    Raises:
        DiskFullError: no room (nothing is left behind); UnsafeFileError: a folder on the way
            is a symlink.
    """
    temporary = temporary_path(path)
    with no_room(path.parent, path.name, len(data)):
        descriptor = _create_exclusively(temporary)
        try:
            with _removed_on_error(temporary):
                _write_all(descriptor, data)
                if durable:
                    os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    if durable:
        fsync_folder(path.parent)


def save_tensors(
    tensors: Mapping[str, torch.Tensor | TensorBytes], path: Path, metadata: dict[str, str]
) -> str:
    """Save ``tensors`` in the safetensors format to ``path``'s temporary file (commit it next
    with :func:`commit_file`, passing the checksum returned); views of one storage are fine,
    and so are :class:`~graphsplit.caching.format.tensor_file.TensorBytes` (the writer's rows).

    graphsplit writes the format itself (:mod:`graphsplit.caching.format.tensor_file`), straight
    from the tensors' memory: no copy, the same write path and errors as every other file, and the
    same bytes on every run, process and safetensors version. Each piece is written by a
    system call of its own (see ``_writes``) and hashed from memory right after the write
    that read it, on the same thread: the file is never read back to be hashed. For a remote
    ``path`` the temporary file is a local staging file, uploaded by the commit.

    Returns:
        The file's checksum (:data:`~graphsplit.caching.format.checksums.ALGORITHM`).

    Raises:
        DiskFullError: no room (nothing is left behind); CacheError: a dtype safetensors lacks.
    """
    pieces, total = serialise(tensors, metadata)
    temporary = temporary_path(path)
    digest = Running()
    with no_room(temporary.parent, path.name, total):
        descriptor = _create_exclusively(temporary)
        try:
            with _removed_on_error(temporary):
                for group in _writes(pieces):
                    _write_all(descriptor, group)
                    for piece in group:
                        digest.update(piece)
        finally:
            os.close(descriptor)
    return digest.checksum()


# How the bytes reach the page cache decides what writing them costs in the kernel. Writes of
# 1 MiB at 1 MiB-aligned offsets (how graphsplit grouped its writes before) cost several
# times the system time in a VM that hands free memory back to its host (Linux 6.18, free
# page reporting of 2 MiB blocks), presumably because they let the page cache allocate large
# folios from memory the host has taken back: 1 GiB of bench_cache_io rows (64 and 236 KB)
# took 1.1-2.1 s of system time in 1 MiB groups and 0.33-0.37 s written one row per call
# (five alternations, each after a save_file), as save_file writes them (0.2-1.0 s). Rows
# of 4 MiB, cut at 256 KiB: 0.28-0.92 s against 0.34-1.72 s (four alternations). So each
# large piece of the file (a tensor's or a row's memory) is written by calls of its own, cut
# at _WRITTEN_AT_ONCE; only runs of small pieces (under _GATHERED: the header, tiny rows)
# share one writev, so that tiny rows do not cost a system call each. Each write's bytes are
# hashed right after it, while they are still in the CPU's caches.
_WRITTEN_AT_ONCE = 256 << 10
_GATHERED = 64 << 10


def _writes(pieces: list[memoryview]) -> Iterator[list[memoryview]]:
    """The pieces of a file in the order they are written, one list per system call: a
    piece of at least ``_GATHERED`` bytes alone (cut at ``_WRITTEN_AT_ONCE``), smaller ones
    gathered while the call stays under ``_GATHERED`` bytes."""
    group: list[memoryview] = []
    size = 0
    for piece in pieces:
        if len(piece) >= _GATHERED:
            if group:
                yield group
                group, size = [], 0
            for start in range(0, len(piece), _WRITTEN_AT_ONCE):
                yield [piece[start : start + _WRITTEN_AT_ONCE]]
            continue
        if group and size + len(piece) > _GATHERED:
            yield group
            group, size = [], 0
        group.append(piece)
        size += len(piece)
    if group:
        yield group


def commit_file(
    temporary: Path, path: Path, *, checksum: str | None = None, durable: bool = True
) -> tuple[int, str]:
    """Fsync a finished temporary file (unless ``durable=False``), then rename it into place.

    ``checksum`` is the one :func:`save_tensors` computed while writing; without it the file
    is read back. The folder is fsync'd once, before the manifest is written: until
    then a rename lost to a power cut only means the shard is redone on resume. For a remote
    ``path`` the (local) temporary file is uploaded whole, then deleted (durable either way).

    Returns:
        The file's size in bytes and its checksum.
    """
    if isinstance(path, RemotePath):
        return remote.upload(temporary, path, checksum or checksum_file(temporary))
    with no_room(path.parent, path.name, None):
        descriptor = open_regular(temporary)
        try:
            with _removed_on_error(temporary):
                if checksum is None:
                    checksum = checksum_descriptor(descriptor, ALGORITHM)
                if durable:
                    os.fsync(descriptor)
                size = os.fstat(descriptor).st_size
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    return size, checksum


@or_remote(nothing)
def fsync_file(path: Path) -> None:
    """Make a committed file's bytes durable (one written with ``durable=False``, reused by a
    durable run); cheap when they are on the disk already."""
    descriptor = open_regular(path)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@or_remote(nothing)
def fsync_folder(folder: Path) -> None:
    """Make renames inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY | CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def no_room(folder: Path, name: str, needed: int | None) -> Iterator[None]:
    """Turn "no room" (disk full, quota, file size limit) while writing ``name`` into a
    :class:`DiskFullError` that says what was needed and that the run resumes."""
    try:
        yield
    except OSError as error:
        if error.errno not in NO_ROOM:
            raise
        try:
            free = f", {human_bytes(free_bytes(folder))} free"
        except OSError:
            free = ""
        size = "" if needed is None else f"; this file needs {human_bytes(needed)}"
        raise user_error(
            DiskFullError,
            f"no room to write {name} in {folder}: the disk is full, or a quota or the file size "
            f"limit was reached ({os.strerror(error.errno)}{size}{free}). Nothing half-written was "
            "kept.",
            fix=Fix(
                "free some space (or raise the limit) and rerun the same graphsplit.cache call: "
                "it resumes from the finished shards"
            ),
        ) from None


@or_remote(nothing)
def free_bytes(folder: Path) -> int | None:
    """The bytes free on the disk holding ``folder`` (None: a remote store, no such limit)."""
    return shutil.disk_usage(folder).free


def _create_exclusively(path: Path) -> int:
    """A new, empty file at ``path``: whatever was there (a leftover, a planted symlink) is
    unlinked first, and ``O_EXCL`` refuses to follow anything planted meanwhile."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
    return os.open(path, flags, FILE_MODE)


def rewrite_descriptor(path: Path, descriptor: int, data: bytes, *, durable: bool = True) -> None:
    """Replace the content of the open file ``path`` with ``data``, durably unless
    ``durable=False`` (the lock file, which is rewritten in place because the lock is on its
    inode)."""
    with no_room(path.parent, path.name, len(data)):
        os.ftruncate(descriptor, 0)
        os.lseek(descriptor, 0, os.SEEK_SET)
        _write_all(descriptor, data)
        if durable:
            os.fsync(descriptor)


def _write_all(descriptor: int, data: Any) -> None:
    """Write all of ``data``: one bytes-like object, or a list of them written in order with
    as few (vectored) system calls as the OS allows."""
    views = [memoryview(piece).cast("B") for piece in (data if isinstance(data, list) else [data])]
    views = [view for view in views if len(view)]
    first = 0
    while first < len(views):
        if _WRITEV is None:
            written = os.write(descriptor, views[first])
        else:
            written = _WRITEV(descriptor, views[first : first + _IOV_MAX])
        while first < len(views) and written >= len(views[first]):
            written -= len(views[first])
            first += 1
        if written:
            views[first] = views[first][written:]


_WRITEV = getattr(os, "writev", None)
_IOV_MAX = 1024  # the least IOV_MAX of the systems with writev


@contextlib.contextmanager
def _removed_on_error(path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def remove_temporary_files(*folders: Path) -> None:
    """Delete the temporary files a stopped run left in ``folders`` (missing or symlinked
    folders are skipped: nothing outside the cache is touched)."""
    for folder in folders:
        if not isinstance(folder, RemotePath) and real_folder(folder, create=False):
            for entry in folder.iterdir():
                if TEMPORARY_FILE.fullmatch(entry.name) and not entry.is_dir():
                    entry.unlink(missing_ok=True)


def real_folder(path: Path, *, create: bool, durable: bool = True) -> bool:
    """Whether ``path`` is a folder and not a symlink to one (created first if ``create``,
    its name fsync'd unless ``durable=False``); on an object store, where folders are
    prefixes, whether anything lies under it.

    Raises:
        UnsafeFileError: ``path`` is a symlink or another kind of file.
    """
    if isinstance(path, RemotePath):
        return create or remote.exists(path)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
            if durable:
                fsync_folder(path.parent)  # the new folder's name survives a power cut too
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(mode):
        raise unsafe_file_error(path, mode)
    return True


@or_remote(remote.list_files)
def list_files(folder: Path) -> list[str]:
    """The names of the entries of ``folder`` that are not folders (symlinks included), sorted;
    none when it does not exist."""
    if not real_folder(folder, create=False):
        return []
    return sorted(e.name for e in folder.iterdir() if e.is_symlink() or not e.is_dir())


@or_remote(remote.remove)
def remove(path: Path) -> None:
    """Delete the file (or symlink) ``path`` if it exists."""
    path.unlink(missing_ok=True)
