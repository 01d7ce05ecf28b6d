"""A local read-through copy of a remote cache's files, in a folder the user names.

``CachedDataset("s3://bucket/cache", split, local_cache="/scratch/x")`` downloads each shard
the first time it is read, checks it against the manifest's size and checksum, and from then
on memory-maps the local copy (:mod:`graphsplit.caching.store.mapped`), as for a local cache.

Glossary:
    copies folder: ``{local_cache}/{digest of the URL}/``: one per remote cache, so one
        ``local_cache`` can serve several caches. Only graphsplit's shard and constants files
        are written there, each atomically (a per-process temporary name, then a rename), so
        DataLoader workers and concurrent jobs can fill it at the same time.
    checksummed copy: a download is always checked against the manifest's checksum before it is
        renamed into place; a copy found there is checked by size, and by checksum too when
        the dataset checksums on first open (``verify=True``, the default), once per process.

In and out::

    LocalCopies(local_cache, url).folder -> Path
    LocalCopies.fetch(record, *, checksum) -> problem | None    # the copy is at folder/record.file
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path

from graphsplit.caching.format.checksums import algorithm_of
from graphsplit.caching.format.layout import FileRecord
from graphsplit.caching.store import file_writes, regular_files, remote
from graphsplit.caching.store.remote import RemotePath

__all__ = ["LocalCopies"]


class LocalCopies:
    """The copies folder of one remote cache (see the module glossary)."""

    def __init__(self, local_cache: str | os.PathLike[str], url: RemotePath) -> None:
        self.url = url
        root = Path(local_cache)
        root.mkdir(parents=True, exist_ok=True)
        file_writes.real_folder(root, create=False)  # no symlinked folder either
        self.folder = root / hashlib.sha256(str(url).encode()).hexdigest()[:16]
        file_writes.real_folder(self.folder, create=True)

    def fetch(self, record: FileRecord, *, checksum: bool) -> str | None:
        """Make ``folder/record.file`` a checksummed copy of the remote file; a problem if the
        remote file is missing or damaged (the local copy is then left as it was)."""
        local = self.folder / record.file
        if regular_files.regular_size(local) == record.bytes and (
            not checksum or regular_files.checksum_file(local) == record.checksum
        ):
            return None
        source = self.url / record.file
        found = remote.size(source)
        if found != record.bytes:
            state = "is missing" if found is None else f"has {found:,} bytes, not {record.bytes:,}"
            return f"{source} {state}"
        temporary = self.folder / f".{record.file}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            with file_writes.no_room(self.folder, record.file, record.bytes):
                remote.download(source, temporary)
            if (
                regular_files.checksum_file(temporary, algorithm_of(record.checksum))
                != record.checksum
            ):
                return f"the copy downloaded from {source} has another checksum (the bytes changed)"
            os.replace(temporary, local)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        return None
