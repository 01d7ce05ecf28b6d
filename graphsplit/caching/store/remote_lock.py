"""The lock of a cache on an object store, where there is no ``flock``.

Glossary:
    lock object: ``.lock`` in the cache folder, created by a conditional put that succeeds
        only when no such object exists (S3's ``If-None-Match: *``, which s3fs sends for
        ``mode="create"``). It holds its writer's pid, host, start time and a random token.
    stale lock: a lock object whose writer died. An object store cannot tell (nothing like the
        kernel dropping a dead process's ``flock``), so a lock is taken over only when it names
        a process on this very host that no longer runs. A run killed on another host leaves
        a lock that its user removes by hand; the error says how.
    takeover: deleting a stale lock and creating a new one. Racers first create
        ``.lock-takeover-{stale token}`` conditionally: one wins, the others are refused.
    fence: before publishing the manifest (and before deleting anything for ``overwrite``)
        the writer reads the lock again and stops unless it still holds its own token, so two
        writers never both publish. Two writers of the same split and loader write byte-equal
        shards under equal names, so an overlap before the fence loses nothing.

Where it is exact: S3 (AWS, and servers that honour ``If-None-Match``: MinIO, moto). Other
fsspec stores may implement the conditional create as check-then-write (not atomic): there,
give each cache prefix one writer (one ``graphsplit cache`` call, which under ``accelerate
launch`` coordinates its own processes).

In and out::

    RemoteLock(path).acquire()   # or CacheLockedError naming the holder and the fix
    RemoteLock(path).confirm()   # the fence: CacheLockedError if another run took the lock
    RemoteLock(path).release()   # deletes the lock object if it is still this run's
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import warnings
from datetime import datetime, timezone
from typing import Any

from graphsplit.caching.store import remote
from graphsplit.caching.store.remote import RemotePath
from graphsplit.errors import CacheError, CacheLockedError, Fix, user_error

__all__ = ["RemoteLock"]

_MAX_LOCK_BYTES = 64 << 10
_MAX_PID = 1 << 22  # Linux's pid_max ceiling: anything larger is garbage, not a process


class RemoteLock:
    """A conditionally created lock object (see the module docstring)."""

    def __init__(self, path: RemotePath) -> None:
        self.path = path
        self.token = secrets.token_hex(16)
        self._claim: RemotePath | None = None
        self.held = False

    def acquire(self) -> None:
        """Create the lock object, taking over a stale one; or raise CacheLockedError."""
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "token": self.token,
        }
        data = json.dumps(owner).encode()
        for _ in range(4):  # another run may release or take over meanwhile: look again
            try:
                remote.put_bytes(self.path, data, exclusive=True)
            except FileExistsError:
                holder = _holder(self.path)
                if holder is None or not _stale(holder):
                    if holder is not None or remote.size(self.path) is not None:
                        raise self._locked_error(holder) from None
                    continue  # released between the put and the read
                self._take_over(holder)
                continue
            self.held = True
            return
        raise self._locked_error(_holder(self.path))

    def confirm(self) -> None:
        """The fence: raise CacheLockedError unless the lock object still holds our token."""
        holder = _holder(self.path)
        if holder is None or holder.get("token") != self.token:
            raise user_error(
                CacheLockedError,
                f"this run lost the lock of the cache folder {self.path.parent}: {self.path} now "
                f"{_describe(holder)}, so this run stops before publishing anything.",
                fix=Fix(
                    "let that run finish (it writes the same shards); if none is running, rerun "
                    "the same call: it resumes"
                ),
            )

    def release(self) -> None:
        """Delete the lock object if it is still ours (and our takeover claim)."""
        if not self.held:
            return
        self.held = False
        try:
            holder = _holder(self.path)
            if holder is not None and holder.get("token") == self.token:
                remote.remove(self.path)
            if self._claim is not None:
                remote.remove(self._claim)
        except CacheError as error:  # never hide the error that ended the run
            warnings.warn(f"graphsplit could not release {self.path}: {error}", stacklevel=2)

    def _take_over(self, holder: dict[str, Any]) -> None:
        claim = self.path.parent / f"{self.path.name}-takeover-{_token(holder)}"
        try:
            remote.put_bytes(claim, self.token.encode(), exclusive=True)
        except FileExistsError:
            raise self._locked_error(holder, taken_over=True) from None
        self._claim = claim
        remote.remove(self.path)

    def _locked_error(
        self, holder: dict[str, Any] | None, *, taken_over: bool = False
    ) -> CacheLockedError:
        why = " (its writer died; another run is taking the cache over)" if taken_over else ""
        return user_error(
            CacheLockedError,
            f"the cache folder {self.path.parent} is being written: {self.path} "
            f"{_describe(holder)}{why}.",
            fix=Fix(
                "wait for that run to finish. If it is dead (killed on another host, or its host "
                f"is gone), delete {self.path} and rerun: an object store cannot tell a dead "
                "writer on another host from a live one"
            ),
        )


def _holder(path: RemotePath) -> dict[str, Any] | None:
    """The owner a lock object names, or None when it is missing, unreadable or garbage."""
    try:
        data = remote.read_bytes(path, limit=_MAX_LOCK_BYTES)
        holder = json.loads(data)
    except (FileNotFoundError, ValueError, RecursionError, CacheError):
        return None
    return holder if isinstance(holder, dict) else None


def _stale(holder: dict[str, Any]) -> bool:
    """Whether the lock names a process of this host that no longer runs."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or type(pid) is not int:
        return False
    if not 0 < pid < _MAX_PID or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists but is another user's
        return False
    return False


def _token(holder: dict[str, Any]) -> str:
    token = holder.get("token")
    if isinstance(token, str) and token.isalnum() and len(token) <= 64:
        return token
    return f"pid{holder.get('pid')}"


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "is missing or does not name its writer"
    return (
        f"names process {holder.get('pid')!r:.30} on host {holder.get('host')!r:.80} since "
        f"{holder.get('since')!r:.40}"
    )
