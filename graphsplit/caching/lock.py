"""The folder lock: one caching run writes a cache folder at a time.

Glossary:
    lock file: ``.lock`` in the cache folder, holding the writer's pid, host, process start
        time and since when it writes, as JSON.
    stale lock: one whose process is gone from this host (or whose pid now belongs to a newer
        process); it is taken over with a warning. A lock held on another host is never stale
        from here: only its owner, or the user, can tell.

In and out::

    FolderLock(path).acquire()      # or CacheLockedError naming the holder and the fix
    FolderLock(path).release()      # removes the lock if this process holds it
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from graphsplit.errors import CacheLockedError

__all__ = ["FolderLock"]

_log = logging.getLogger("graphsplit")


class FolderLock:
    """An exclusive lock file holding the writer's pid, host and process start time.

    It is created with ``os.link`` from a private file, which is atomic (NFS included) and
    fails if the lock exists. A stale lock is taken over; any other lock is refused with a
    message saying who holds it.
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
                    _create_exclusively(self.path, content_of=private)
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


def _create_exclusively(path: Path, *, content_of: Path) -> None:
    """Create ``path`` with the bytes of ``content_of``, or raise FileExistsError if it exists."""
    try:
        os.link(content_of, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: exclusive create, then write
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(content_of.read_bytes())


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
