"""A local read-through copy of a remote cache's files, in a folder the user names.

``CachedDataset("s3://bucket/cache", split, local_cache="/scratch/x")`` downloads each shard
the first time it is read, checks it against the manifest's size and checksum, and from then
on memory-maps the local copy (:mod:`graphsplit.caching.store.mapped`), as for a local cache.

Glossary:
    copies folder: ``{local_cache}/by-checksum/``: each copy is named by the checksum the
        manifest records for its file (``xxh3-0123….safetensors``), not by its URL, so a
        remote cache rebuilt at the same URL never serves an old copy (its files have other
        checksums), and identical files of several caches share one copy. Copies are written
        atomically (a per-process temporary name, then a rename), so DataLoader workers and
        concurrent jobs can fill the folder at the same time.
    checksummed copy: a download is always checked against the manifest's checksum before it
        is renamed into place; a copy found there is checked by size, and by checksum too when
        the dataset checksums on first open (``verify=True``, the default, from the same map
        it then reads: :func:`~graphsplit.caching.store.mapped.open_mapped`).

In and out::

    LocalCopies(local_cache).folder -> Path
    LocalCopies.fetch(url, record, *, fresh=False) -> Path of the copy | problem (str)
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from graphsplit.caching.format.checksums import algorithm_of
from graphsplit.caching.format.layout import FileRecord
from graphsplit.caching.store import file_writes, regular_files, remote
from graphsplit.caching.store.pinned_object import open_pinned
from graphsplit.caching.store.remote import RemotePath

__all__ = ["LocalCopies"]

_COPIES = "by-checksum"


class LocalCopies:
    """The copies folder of a ``local_cache`` (see the module glossary)."""

    def __init__(self, local_cache: str | os.PathLike[str]) -> None:
        root = Path(local_cache)
        root.mkdir(parents=True, exist_ok=True)
        file_writes.real_folder(root, create=False)  # no symlinked folder either
        self.folder = root / _COPIES
        file_writes.real_folder(self.folder, create=True)

    def copy_path(self, record: FileRecord) -> Path:
        """Where the copy of ``record``'s file lies: named by its checksum (a strict pattern
        of the manifest: an algorithm and hex digits, nothing that leaves the folder)."""
        suffix = Path(record.file).suffix
        return self.folder / f"{record.checksum.replace(':', '-')}{suffix}"

    def fetch(self, url: RemotePath, record: FileRecord, *, fresh: bool = False) -> Path | str:
        """A copy of the remote file ``url`` whose bytes the manifest's ``record`` describes:
        one already there of the right size (unless ``fresh``: a copy found damaged), or a
        checksummed download; a problem if the remote file is missing, changed or damaged (the
        local copy is then left as it was)."""
        local = self.copy_path(record)
        if not fresh and regular_files.regular_size(local) == record.bytes:
            return local
        pinned = open_pinned(url, record)  # size and version (ETag) before downloading
        if isinstance(pinned, str):
            return f"{url}: {pinned}"
        temporary = self.folder / f".{local.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            with file_writes.no_room(self.folder, local.name, record.bytes):
                remote.download(url, temporary)
            if (
                regular_files.checksum_file(temporary, algorithm_of(record.checksum))
                != record.checksum
            ):
                return f"the copy downloaded from {url} has another checksum (the bytes changed)"
            os.replace(temporary, local)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        return local
