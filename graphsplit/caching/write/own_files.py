"""Which files in a cache folder graphsplit wrote, recognised by name and content.

graphsplit deletes or replaces only its own files. A folder can hold other things: a
``.env.tmp`` an editor left, another tool's ``manifest.json``. Deleting those because their
names look like graphsplit's would lose someone's data, so a name alone is not enough where it
could be someone else's:

Glossary:
    own temporary file: ``.graphsplit-{name}.{pid}-{token}.tmp``
        (:data:`~graphsplit.caching.store.file_writes.TEMPORARY_FILE`): no other tool writes
        that name, so the name suffices.
    own manifest: ``manifest.json`` whose first bytes are graphsplit's stamp
        (``{"format": "graphsplit-cache"``, the first key graphsplit writes). Any other
        ``manifest.json`` is another tool's: ``cache()`` refuses the folder even with
        ``overwrite=True`` (which would delete it) and says to choose another folder or move
        the file away.

    own progress record: in ``.partial/``, ``header.json`` (``plan.json`` from graphsplit
        0.1), ``constants.json`` and ``shard-NNNNN.json``; ``.partial`` is a common name, so
        anything else there (``notes.json``) is left alone when the records are removed.

In and out::

    manifest_is_ours(folder) -> bool | None      # None: no manifest.json there
    refuse_foreign_manifest(folder)              # StaleCacheError naming the file and the fix
    is_progress_record(name) -> bool             # a name graphsplit writes in .partial/
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from graphsplit.caching.format.layout import (
    CONSTANTS_PROGRESS_FILE,
    FORMAT,
    MANIFEST_FILE,
    RESUME_HEADER_FILE,
    RESUME_HEADER_FILE_0_1,
    SHARD_PROGRESS_PATTERN,
)
from graphsplit.caching.store import regular_files, remote
from graphsplit.caching.store.remote import RemotePath
from graphsplit.errors import Fix, StaleCacheError, UnsafeFileError, user_error

__all__ = ["is_progress_record", "manifest_is_ours", "refuse_foreign_manifest"]

_STAMP = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + re.escape(FORMAT.encode()) + rb'"')
_PREFIX = 256  # bytes read: the stamp is the first key, well inside this


def _first_bytes(path: Path) -> bytes:
    if isinstance(path, RemotePath):
        size = remote.size(path) or 0
        return remote.read_prefix(path, min(size, _PREFIX)) if size else b""
    descriptor = regular_files.open_regular(path)  # UnsafeFileError: not a regular file
    try:
        return os.read(descriptor, _PREFIX)
    finally:
        os.close(descriptor)


def manifest_is_ours(folder: Path) -> bool | None:
    """Whether ``folder/manifest.json`` carries graphsplit's stamp (None: there is none, or
    it is a symlink, FIFO, device or folder, never opened here: the manifest's reader refuses
    those with its own error)."""
    path = folder / MANIFEST_FILE
    if not regular_files.exists(path):
        return None
    try:
        return _STAMP.match(_first_bytes(path)) is not None
    except UnsafeFileError:
        return None


def refuse_foreign_manifest(folder: Path) -> None:
    """Refuse ``folder`` when its ``manifest.json`` is another tool's (see the glossary).

    Raises:
        StaleCacheError: whatever ``overwrite`` says; the fix keeps the file.
    """
    if manifest_is_ours(folder) is False:
        raise user_error(
            StaleCacheError,
            f"the folder {folder} holds a {MANIFEST_FILE} that graphsplit did not write (it does "
            f'not open with graphsplit\'s stamp {{"format": "{FORMAT}"}}); graphsplit neither '
            "reads nor replaces it, even with overwrite=True.",
            fix=Fix(
                f"write the cache to another (new or empty) folder, or move {MANIFEST_FILE} out "
                "of this one if it is yours to move"
            ),
        )


def is_progress_record(name: str) -> bool:
    """Whether ``name`` is one of the records graphsplit writes in ``.partial/``."""
    return name in (
        RESUME_HEADER_FILE,
        RESUME_HEADER_FILE_0_1,
        CONSTANTS_PROGRESS_FILE,
    ) or bool(SHARD_PROGRESS_PATTERN.fullmatch(name))
