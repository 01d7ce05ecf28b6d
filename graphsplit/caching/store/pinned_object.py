"""One object of a remote cache, opened once and pinned to the version the manifest records.

An object store has no file descriptor to hold: an object replaced after it was checked
would be served to the next ranged read. So each remote file of a cache is opened once per
process (:func:`open_pinned`), and its version (S3's ETag, recorded in the manifest's file
record when the file was written) is compared with the record's at that open; every read
after it goes through the same open object, which on S3 sends the version with each request
(``If-Match``): a replaced object fails the request instead of serving other bytes. The
checksum (``verify=True``) is streamed through that same open object, so the bytes checked
are the bytes read.

Glossary:
    pinned version: the record's ``etag``; for a cache written before records held one, the
        version found at the first open (so one process never mixes two versions).
    changed object: an object whose version is not the pinned one: refused with a
        :class:`~graphsplit.errors.CorruptCacheError` naming the URL and the fix (rebuild).

In and out::

    open_pinned(path, record) -> PinnedObject | problem (str)
    PinnedObject.read(start, end) -> bytes     # CorruptCacheError: the object changed
    PinnedObject.checksum(algorithm) -> str
"""

from __future__ import annotations

import os
import threading
from typing import Any

from graphsplit.caching.format.checksums import Running
from graphsplit.caching.format.layout import FileRecord
from graphsplit.caching.format.records import REBUILD
from graphsplit.caching.store import remote
from graphsplit.caching.store.remote import RemotePath
from graphsplit.errors import CorruptCacheError, Fix, Remedy, user_error

__all__ = ["PinnedObject", "changed_object_error", "open_pinned"]

_CHUNK = 8 << 20


class PinnedObject:
    """An open remote object at its pinned version (see the module docstring)."""

    def __init__(self, path: RemotePath, size: int, version: str | None, handle: Any) -> None:
        self.path = path
        self.size = size
        self.version = version
        self._handle = handle
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the pinned version (one request)."""
        if end <= start:
            return b""
        if self._pid != os.getpid():  # a forked child: the parent's lock may be held there
            self._lock = threading.Lock()
        with self._lock:
            handle = self._current()
            data = self._request(lambda: (handle.seek(start), handle.read(end - start))[1])
        if len(data) != end - start:
            how = f"it returned {len(data)} bytes for the range {start}-{end}"
            raise changed_object_error(self.path, how)
        return bytes(data)

    def checksum(self, algorithm: str) -> str:
        """The checksum of the pinned version's bytes, streamed in 8 MiB pieces."""
        running = Running(algorithm)
        for start in range(0, self.size, _CHUNK):
            running.update(self.read(start, min(start + _CHUNK, self.size)))
        return running.checksum()

    def _current(self) -> Any:
        """The open object; reopened (and its version compared again) in a forked process,
        whose store client cannot be the parent's."""
        if self._pid != os.getpid():
            opened = _open(self.path)
            if opened is None or _version(opened) != self.version or opened.size != self.size:
                raise changed_object_error(self.path, "it was replaced or removed")
            self._handle, self._pid = opened, os.getpid()
        return self._handle

    def _request(self, call: Any) -> Any:
        with remote.storage_requests(self.path, "read"):
            try:
                return call()
            except FileNotFoundError:
                raise changed_object_error(self.path, "it was removed") from None
            except OSError as error:
                if _expired(error):
                    how = "the store now holds another version"
                    raise changed_object_error(self.path, how) from None
                raise


def open_pinned(path: RemotePath, record: FileRecord) -> PinnedObject | str:
    """Open ``path`` for reads pinned to ``record``'s version; a problem (in words) if it is
    missing, has another size, or is another version than the record's."""
    handle = _open(path)
    if handle is None:
        return "the file is missing"
    if handle.size != record.bytes:
        return f"it has {handle.size:,} bytes, the manifest records {record.bytes:,}"
    found = _version(handle)
    if record.etag is not None and found != record.etag:
        return (
            f"it changed after the cache was written (the store holds version {found}, the "
            f"manifest records {record.etag}): another run or tool replaced it"
        )
    return PinnedObject(path, record.bytes, record.etag or found, handle)


def changed_object_error(path: RemotePath, how: str) -> CorruptCacheError:
    """The error for an object that changed while a reader held it open."""
    return user_error(
        CorruptCacheError,
        f"{path} changed while it was being read ({how}): another run or tool replaced it "
        "after the cache was written, so its bytes are not the ones the manifest records.",
        fix=Fix(f"run graphsplit.check_cache on the cache, then {REBUILD}", Remedy.OVERWRITE),
    )


def _open(path: RemotePath) -> Any | None:
    """The object opened for unbuffered reads (each read one request), or None if missing."""
    try:
        with remote.storage_requests(path, "read"):
            return path.fs.open(path.path, "rb", cache_type="none")
    except (FileNotFoundError, IsADirectoryError):
        return None


def _version(handle: Any) -> str | None:
    return remote.version_of(getattr(handle, "details", None) or {})


def _expired(error: OSError) -> bool:
    """A read refused because the object is no longer the version opened (s3fs's
    ``FileExpired``, an ``If-Match`` precondition that failed)."""
    if type(error).__name__ == "FileExpired":
        return True
    text = str(error).lower()
    return "precondition" in text or "pre-conditions" in text
