"""The cache's records on disk: the manifest, the resume header and the progress records, read
and written through :mod:`graphsplit.caching.store.file_writes` (so a local folder and a remote
store alike).

What the records hold and their JSON form are the format's
(:mod:`graphsplit.caching.format.layout`, :mod:`graphsplit.caching.format.record_documents`);
this module only decides where their bytes live and when they are fsync'd.

Glossary:
    complete: a folder holds a complete cache iff ``manifest.json`` exists; it is written
        last, atomically.
    resume header: ``.partial/header.json`` (or graphsplit 0.1's ``.partial/plan.json``, read,
        never written): a run started there and has not finished or been cleaned up.
    progress record: ``.partial/shard-*.json`` or ``.partial/constants.json``, one per
        finished file; a missing or unreadable one only means redoing that file, so reading one
        answers None rather than an error.

In and out::

    read_manifest(folder) -> Manifest                    write_manifest(folder, manifest)
    read_resume_header(folder) -> CacheHeader | None     write_resume_header(folder, header)
    has_resume_header(folder) -> bool
    read_shard_progress(folder, index, header) -> ShardProgress | None
    read_constants_progress(folder, header) -> ConstantsProgress | None
    write_progress(folder, progress)                     # either kind of progress record
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphsplit.caching.format.layout import (
    CONSTANTS_PROGRESS_FILE,
    FORMAT,
    MANIFEST_FILE,
    PARTIAL_DIR,
    RESUME_HEADER_FILE,
    RESUME_HEADER_FILE_0_1,
    CacheHeader,
    ConstantsProgress,
    Manifest,
    ShardProgress,
    shard_progress_name,
)
from graphsplit.caching.format.record_documents import (
    constants_progress_from,
    manifest_bytes,
    manifest_from,
    progress_bytes,
    progress_file_name,
    resume_header_bytes,
    resume_header_from,
    shard_progress_from,
)
from graphsplit.caching.format.records import DAMAGED_FILE_FIX, REBUILD, JsonReader
from graphsplit.caching.store.file_writes import real_folder, write_atomically
from graphsplit.caching.store.regular_files import exists, read_regular
from graphsplit.errors import Fix, ManifestError, Remedy, UnsafeFileError, user_error

__all__ = [
    "has_resume_header",
    "read_constants_progress",
    "read_manifest",
    "read_resume_header",
    "read_shard_progress",
    "write_manifest",
    "write_progress",
    "write_resume_header",
]

MAX_JSON_BYTES = 1 << 30  # a manifest of ten million samples is well below this


# ------------------------------------------------------------------------------------ writing


def write_manifest(folder: Path, manifest: Manifest, *, durable: bool = True) -> None:
    """Write ``manifest.json`` atomically (fsync'd unless ``durable=False``)."""
    write_atomically(folder / MANIFEST_FILE, manifest_bytes(manifest), durable=durable)


def write_resume_header(folder: Path, header: CacheHeader, *, durable: bool = True) -> None:
    """Record the header a run starts with, in ``.partial/header.json`` (fsync'd unless
    ``durable=False``: a header a power cut damaged is read as torn, and resuming then
    keeps only the shards that verify)."""
    real_folder(folder / PARTIAL_DIR, create=True, durable=durable)
    data = resume_header_bytes(header)
    write_atomically(folder / PARTIAL_DIR / RESUME_HEADER_FILE, data, durable=durable)


def write_progress(folder: Path, progress: ShardProgress | ConstantsProgress) -> None:
    """Record a finished shard or constants file in ``.partial/`` (after its file's rename).

    Durable like every file graphsplit writes; a lost or damaged one only means redoing
    that file.
    """
    real_folder(folder / PARTIAL_DIR, create=True)
    name = progress_file_name(progress)
    write_atomically(folder / PARTIAL_DIR / name, progress_bytes(progress))


# ------------------------------------------------------------------------------------ reading

FOREIGN_MANIFEST_FIX = Fix(
    "point graphsplit at the folder graphsplit.cache wrote (graphsplit never replaces or "
    "deletes a file it did not write; cache into a new or empty folder)"
)


def read_manifest(folder: Path) -> Manifest:
    """Read ``folder/manifest.json`` strictly (every field, type and rule).

    Raises:
        ManifestError: the folder holds no manifest, or it is malformed, of another format
            version, or names files outside the folder; the message names the field.
    """
    path = folder / MANIFEST_FILE
    if not exists(path):
        reason = f"no graphsplit cache at {folder}: {MANIFEST_FILE} is missing"
        if has_resume_header(folder):
            # The reason keeps saying what to do: tests and users grep "did not finish; rerun".
            reason += " (a caching run started there but did not finish; rerun graphsplit.cache)"
            fix = Fix("rerun graphsplit.cache with the same arguments to complete it")
        else:
            fix = Fix("check the path, or write a cache there with graphsplit.cache")
        raise user_error(ManifestError, reason, fix=fix)
    reader, document = _load(path)
    if document.get("format") != FORMAT:
        # Another tool's manifest.json: never "rebuild with overwrite=True" (cache() refuses
        # to replace a file it did not write, see caching/write/own_files.py).
        found = f"format is {document['format']!r}" if "format" in document else "has no format"
        raise user_error(
            ManifestError,
            f"{path} is not a graphsplit manifest (its {found}, expected {FORMAT!r}): the "
            "folder belongs to another tool or holds other data",
            fix=FOREIGN_MANIFEST_FIX,
        )
    return manifest_from(reader, document)


def has_resume_header(folder: Path) -> bool:
    """Whether a caching run started in ``folder`` (and has not finished or been cleaned up)."""
    partial = folder / PARTIAL_DIR
    names = (RESUME_HEADER_FILE, RESUME_HEADER_FILE_0_1)
    return any(exists(partial / name) for name in names)


def read_resume_header(folder: Path) -> CacheHeader | None:
    """The header of an interrupted run in ``folder``, or None when there is none.

    Reads ``.partial/header.json``, or ``.partial/plan.json`` where graphsplit 0.1 left one.
    """
    for name in (RESUME_HEADER_FILE, RESUME_HEADER_FILE_0_1):
        path = folder / PARTIAL_DIR / name
        if exists(path):
            return resume_header_from(*_load(path))
    return None


def read_shard_progress(folder: Path, index: int, header: CacheHeader) -> ShardProgress | None:
    """The progress record of shard ``index``, or None when absent or unreadable."""
    path = folder / PARTIAL_DIR / shard_progress_name(index)
    if not exists(path):
        return None
    try:
        reader, document = _load(path)
        return shard_progress_from(reader, document, index, header)
    except ManifestError:
        return None  # written atomically, so this is foreign or damaged: redo the shard


def read_constants_progress(folder: Path, header: CacheHeader) -> ConstantsProgress | None:
    """The progress record of the constants file, or None when absent or unreadable."""
    path = folder / PARTIAL_DIR / CONSTANTS_PROGRESS_FILE
    if not exists(path):
        return None
    try:
        reader, document = _load(path)
        return constants_progress_from(reader, document, header)
    except ManifestError:
        return None


def _load(path: Path) -> tuple[JsonReader, dict[str, Any]]:
    """The record file at ``path`` (a regular file of at most 1 GiB) as a JSON object, and the
    reader that names it in errors.

    Raises:
        ManifestError: it cannot be read, is not a regular file or not a JSON object
            (TornFileError: empty or not JSON at all).
    """
    reader = JsonReader(path)
    try:
        data = read_regular(path, limit=MAX_JSON_BYTES)
    except UnsafeFileError as error:
        raise user_error(
            ManifestError, error.reason or str(error), fix=error.fix or DAMAGED_FILE_FIX
        ) from None
    except OSError as error:
        raise user_error(
            ManifestError,
            f"{path} cannot be read ({error.strerror or error}).",
            fix=Fix(f"check its permissions, or {REBUILD}", Remedy.OVERWRITE),
        ) from None
    return reader, reader.parse(data)
