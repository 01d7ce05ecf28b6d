"""Whether a cache's files can be trusted after the machine that wrote them restarted.

A durable cache (``cache(..., durable=True)``, the default) fsyncs every file before anything
names it, so it survives a power cut. ``durable=False`` skips the fsyncs and keeps the same
guarantee as a bare ``safetensors.save_file``: the files are right as long as the page cache
that holds them is, which survives a crash of the process (``kill -9``) but not of the
machine (a power cut, a kernel panic, a VM stopped): after that a shard may hold zeros or
old blocks. So the manifest of such a cache records the boot it was written in, and a
reader in another boot trusts no file before its checksum matches.

Glossary:
    boot id: ``/proc/sys/kernel/random/boot_id``, a random id Linux draws at each boot; empty
        where there is none (not Linux), so that every boot counts as another.
    unsynced cache: one whose manifest holds ``unsynced``
    (:class:`~graphsplit.caching.format.layout.
        Unsynced`); a cache on an object store never is (a put is durable once it returns).
    restarted: the boot id now differs from the one an unsynced cache recorded. Reading then
        verifies every file's checksum (``CachedDataset`` as with ``verify=True``;
        ``check_cache`` always does), and ``cache()`` verifies them all before it keeps the
        cache; once they match, it fsyncs them and records the cache as durable.

In and out::

    boot_id() -> str                                  # "" when unknown
    unsynced_record(folder, *, durable) -> Unsynced | None    # what the manifest records
    restarted_since(manifest) -> bool                 # its files need their checksums checked
    restart_cause(manifest) -> str                    # " (...)" for a damaged file's message
"""

from __future__ import annotations

import functools
from pathlib import Path

from graphsplit.caching.format.layout import BOOT_ID, Manifest, Unsynced
from graphsplit.caching.store.remote import RemotePath

__all__ = ["BOOT_ID_FILE", "boot_id", "restart_cause", "restarted_since", "unsynced_record"]

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def boot_id() -> str:
    """This boot's id (read once per process: it cannot change while the process runs)."""
    try:
        text = BOOT_ID_FILE.read_text(encoding="ascii").strip().lower()
    except (OSError, UnicodeDecodeError):
        return ""
    return text if BOOT_ID.fullmatch(text) else ""


def unsynced_record(folder: Path | RemotePath, *, durable: bool) -> Unsynced | None:
    """What the manifest of a cache written in ``folder`` records: None when it is durable
    (fsync'd, or on an object store, whose puts are durable anyway)."""
    if durable or isinstance(folder, RemotePath):
        return None
    return Unsynced(boot_id())


def restarted_since(manifest: Manifest) -> bool:
    """Whether ``manifest`` is of an unsynced cache written in another boot (or one that
    cannot be told apart from this one), so its files must be verified before use."""
    unsynced = manifest.unsynced
    return unsynced is not None and (not unsynced.boot_id or unsynced.boot_id != boot_id())


def restart_cause(manifest: Manifest) -> str:
    """What to add to a damaged file's message when a restart explains it ("" otherwise)."""
    if not restarted_since(manifest):
        return ""
    return (
        " (the cache was written with durable=False, without fsync, and the machine has "
        "restarted since: the restart lost bytes not yet on the disk)"
    )
