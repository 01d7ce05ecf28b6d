"""Regular files only: how graphsplit reads a cache folder's files and refuses anything else.

A planted symlink must not lead a reader out of the folder, a FIFO must not hang it, and a
device must not be opened at all; every read of a cache file starts here.

Glossary:
    regular: a plain file, not a symlink, FIFO, device or folder. Readers check with ``lstat``
        and open with ``O_NOFOLLOW | O_NONBLOCK``, so a planted FIFO cannot hang them and a
        symlink cannot lead them out of the folder (:class:`UnsafeFileError` otherwise).
    pinned name: a name that opens the very file checked (``/proc/self/fd/N`` on Linux), for
        libraries that open by name (safetensors): swapping the file after the check changes
        nothing.
    checksum: of a file's bytes, in the algorithm its record names
        (:mod:`graphsplit.caching.format.checksums`), read from a read-only memory map.

In and out::

    regular_size(path) -> int | None                  # None: missing; UnsafeFileError
    read_regular(path, *, limit) -> bytes             # UnsafeFileError, FileNotFoundError
    pinned(path) -> name                              # for libraries that open by name
    pinned_map(path) -> (name, mmap)                  # the same, and a private memory map
    checksum_file(path, algorithm="xxh3") -> str      file_matches(path, *, size, checksum)
    exists(path) -> bool                              # anything there, even a dangling symlink
    open_regular(path) -> descriptor    is_regular(descriptor) -> bool
    checksum_descriptor(descriptor, algorithm) -> str
    unsafe_file_error(path, mode) -> UnsafeFileError  # naming what kind of file it is

Each that takes a path also takes a :class:`~graphsplit.caching.store.remote.RemotePath` and
does the same on the store (see :mod:`graphsplit.caching.store.remote`), except ``pinned`` and
``pinned_map``: remote shards are read by byte ranges (:mod:`graphsplit.caching.store.ranged`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from graphsplit.caching.format.checksums import ALGORITHM, Running, algorithm_of
from graphsplit.caching.format.records import DAMAGED_FILE_FIX
from graphsplit.caching.store import remote
from graphsplit.caching.store.remote import or_remote
from graphsplit.errors import Fix, UnsafeFileError, user_error
from graphsplit.units import human_bytes

__all__ = [
    "CLOEXEC",
    "NOFOLLOW",
    "NONBLOCK",
    "checksum_descriptor",
    "checksum_file",
    "exists",
    "file_matches",
    "is_regular",
    "open_regular",
    "pinned",
    "pinned_map",
    "read_regular",
    "regular_size",
    "unsafe_file_error",
]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_PROC_FDS = Path("/proc/self/fd")
_PROC_FDS = Path("/proc/self/fd")


@or_remote(remote.size)
def regular_size(path: Path) -> int | None:
    """The size of the regular file ``path``, or None when it does not exist.

    Raises:
        UnsafeFileError: it is a symlink, FIFO, device or folder.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise unsafe_file_error(path, info.st_mode)
    return info.st_size


@or_remote(remote.read_bytes)
def read_regular(path: Path, *, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused above ``limit`` bytes.

    Raises:
        FileNotFoundError; UnsafeFileError: not a regular file, or larger than ``limit``.
    """
    descriptor = open_regular(path)
    try:
        size = os.fstat(descriptor).st_size
        if size > limit:
            raise user_error(
                UnsafeFileError,
                f"{path} holds {human_bytes(size)}, more than the {human_bytes(limit)} a "
                "graphsplit cache file of its kind can hold.",
                fix=DAMAGED_FILE_FIX,
            )
        with os.fdopen(os.dup(descriptor), "rb") as handle:
            return handle.read(limit + 1)[:limit]
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def pinned(path: Path) -> Iterator[str]:
    """A name for the regular file ``path`` as checked now, for libraries that open by name
    (safetensors): on Linux ``/proc/self/fd/N`` of an ``O_NOFOLLOW`` descriptor, so swapping
    the file for a symlink after the check changes nothing."""
    descriptor = open_regular(path)
    try:
        yield _descriptor_name(descriptor, path)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def pinned_map(path: Path) -> Iterator[tuple[str, mmap.mmap]]:
    """:func:`pinned`'s name for ``path`` and a private, copy-on-write memory map of the same
    file (so tensors can be views of it; writing to them never changes the file). The map
    outlives the context: it is closed when nothing refers to it any more.

    Raises:
        UnsafeFileError, FileNotFoundError; ValueError: the file is empty.
    """
    descriptor = open_regular(path)
    try:
        mapped = mmap.mmap(descriptor, 0, access=mmap.ACCESS_COPY)
        yield _descriptor_name(descriptor, path), mapped
    finally:
        os.close(descriptor)


@or_remote(remote.checksum)
def checksum_file(path: Path, algorithm: str = ALGORITHM) -> str:
    """The checksum of a regular file's bytes, from a read-only memory map (a remote object
    is streamed)."""
    descriptor = open_regular(path)
    try:
        return checksum_descriptor(descriptor, algorithm)
    finally:
        os.close(descriptor)


def file_matches(path: Path, *, size: int, checksum: str) -> bool:
    """Whether ``path`` is a regular file with exactly this size and checksum (else: no)."""
    try:
        algorithm = algorithm_of(checksum)
        return regular_size(path) == size and checksum_file(path, algorithm) == checksum
    except (OSError, UnsafeFileError):
        return False


@or_remote(remote.exists)
def exists(path: Path) -> bool:
    """Whether anything, even a dangling symlink, is at ``path`` (readers then judge it)."""
    return os.path.lexists(path)


def is_regular(descriptor: int) -> bool:
    """Whether an open descriptor is a regular file."""
    return stat.S_ISREG(os.fstat(descriptor).st_mode)


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``; never follows a symlink and never
    waits on a FIFO."""
    regular_size(path)  # refuse special files before opening them: opening a device can act
    try:
        descriptor = os.open(path, os.O_RDONLY | NOFOLLOW | NONBLOCK | CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise unsafe_file_error(path, stat.S_IFLNK) from None
        raise
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):  # swapped between the check and the open
        os.close(descriptor)
        raise unsafe_file_error(path, mode)
    return descriptor


def checksum_descriptor(descriptor: int, algorithm: str) -> str:
    """The checksum of an open regular file's bytes, from a read-only memory map."""
    running = Running(algorithm)
    if os.fstat(descriptor).st_size:
        with mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ) as mapped:
            running.update(mapped)
    return running.checksum()


def unsafe_file_error(path: Path, mode: int) -> UnsafeFileError:
    """The error refusing ``path``, naming the kind of file it is (by its ``mode``)."""
    kinds = [
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a regular file"),
    ]
    kind = next((name for test, name in kinds if test(mode)), "a special file")
    return user_error(
        UnsafeFileError,
        f"{path} is {kind}, not what graphsplit wrote there; graphsplit reads and writes only "
        "regular files and folders inside the cache folder, never through symlinks.",
        fix=Fix(
            f"delete {path} (or the whole cache) and rerun graphsplit.cache; if the cache was "
            "copied, copy it without symlinks (cp -rL)"
        ),
    )


def _descriptor_name(descriptor: int, path: Path) -> str:
    """A name that opens the very file ``descriptor`` refers to (Linux), else ``path``."""
    return str(_PROC_FDS / str(descriptor)) if _PROC_FDS.is_dir() else str(path)
