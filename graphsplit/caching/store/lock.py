"""The folder lock: one caching run writes a cache folder at a time.

Glossary:
    lock file: ``.lock`` in the cache folder. The lock is the operating system's exclusive
        ``flock`` on it, not the file's existence; the file's JSON (the writer's pid, host and
        since when it writes) only names the holder in the error others get.
    stale lock: a lock file whose writer died. The kernel drops a dead process's ``flock``
        itself (on NFS the server does, once the client's lease lapses), so a stale lock file
        is simply locked again: no pid is ever guessed at, and two runs that find the same
        stale file cannot both take it.
    release: delete the lock file, only while it is still the one this process locked (same
        device and inode), then unlock.

Why ``flock`` rather than a pid file: taking over a stale pid file needs a check and an unlink
that are not atomic together, and a pid can be reused; a kernel lock has neither problem. On
local filesystems it is exact. On NFS, Linux clients map ``flock`` to NFS byte-range locks
(NFSv4, or NFSv3 with ``lockd``), which lock across hosts; filesystems without locks (some FUSE
mounts, Lustre without ``-o flock``) are reported with a :class:`CacheError`, never silently
unlocked.

In and out::

    FolderLock(path, durable=True).acquire()    # or CacheLockedError naming the holder
    FolderLock(path).release()      # removes the lock file if this process holds it
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from graphsplit.caching.store import file_writes, regular_files
from graphsplit.errors import CacheError, CacheLockedError, Fix, UnsafeFileError, user_error

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

__all__ = ["FolderLock"]

_MAX_LOCK_BYTES = 64 << 10
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class FolderLock:
    """An exclusive ``flock`` on the folder's lock file (see the module docstring)."""

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        self.path = path
        # The holder's name is only read by other runs, through the page cache; a run that
        # fsyncs nothing (cache(durable=False)) does not fsync it either.
        self.durable = durable
        self._descriptor: int | None = None

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def acquire(self) -> None:
        """Lock the folder, or raise CacheLockedError naming the holder."""
        if fcntl is None:
            raise user_error(
                CacheError,
                "graphsplit.cache needs flock to lock the cache folder, which this platform lacks.",
                fix=Fix("cache on Linux or macOS"),
            )
        for _ in range(8):  # a release that deletes the file under us: lock the new one
            descriptor = self._open()
            try:
                locked = self._lock(descriptor)
                if locked and _same_file(descriptor, self.path):
                    self._descriptor = descriptor
                    self._record_owner(descriptor)
                    return
            except BaseException:
                os.close(descriptor)
                raise
            os.close(descriptor)
            if not locked:
                raise self._locked_error()
        raise self._locked_error()

    def release(self) -> None:
        """Delete the lock file if it is still the one this process locked, then unlock."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is None:
            return
        try:
            if _same_file(descriptor, self.path):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
        finally:
            os.close(descriptor)  # closing drops the flock

    def _open(self) -> int:
        """The lock file, created if missing; never through a symlink, never a FIFO."""
        regular_files.regular_size(self.path)  # refuse a planted special file before opening it
        flags = (
            os.O_RDWR
            | os.O_CREAT
            | regular_files.NOFOLLOW
            | regular_files.NONBLOCK
            | regular_files.CLOEXEC
        )
        try:
            with file_writes.no_room(self.path.parent, self.path.name, None):
                descriptor = os.open(self.path, flags, file_writes.FILE_MODE)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                regular_files.regular_size(self.path)  # names what is there
            raise
        if not regular_files.is_regular(descriptor):  # swapped between the check and the open
            os.close(descriptor)
            regular_files.regular_size(self.path)
            raise user_error(
                UnsafeFileError,
                f"{self.path} changed while graphsplit opened it",
                fix=Fix(f"make sure no other program replaces {self.path}, then rerun"),
            )
        return descriptor

    def _lock(self, descriptor: int) -> bool:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                raise
            raise user_error(
                CacheError,
                f"the filesystem holding {self.path.parent} does not support file locks "
                f"({os.strerror(error.errno)}), so graphsplit cannot keep two runs from writing "
                "the cache at once.",
                fix=Fix(
                    "cache to a local disk or to an NFS mount with locking (NFSv4, or NFSv3 with "
                    "lockd); on Lustre mount with -o flock"
                ),
            ) from None
        return True

    def _record_owner(self, descriptor: int) -> None:
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        data = json.dumps(owner).encode()
        file_writes.rewrite_descriptor(self.path, descriptor, data, durable=self.durable)

    def _locked_error(self) -> CacheLockedError:
        holder = _holder(self.path)
        if holder is None:
            who = "another process (the lock file does not name it)"
        else:
            who = (
                f"process {holder.get('pid')!r:.30} on host {holder.get('host')!r:.80} since "
                f"{holder.get('since')!r:.40}"
            )
        return user_error(
            CacheLockedError,
            f"the cache folder {self.path.parent} is being written by {who}.",
            fix=Fix(
                "wait for that run to finish. Its lock is released when it exits, even if it is "
                f"killed; deleting {self.path} does not stop it"
            ),
        )


def _holder(path: Path) -> dict[str, Any] | None:
    """The owner a lock file names, or None when it is unreadable or garbage."""
    try:
        holder = json.loads(regular_files.read_regular(path, limit=_MAX_LOCK_BYTES))
    except (OSError, ValueError, RecursionError, UnsafeFileError):
        return None
    return holder if isinstance(holder, dict) else None


def _same_file(descriptor: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``descriptor`` has open."""
    try:
        here, there = os.fstat(descriptor), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
