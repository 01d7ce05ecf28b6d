"""Crash-safe file writing: temporary names, fsync, atomic renames, checksums, free space.

Glossary:
    temporary file: ``.{name}.tmp`` next to the file it becomes; a run that dies leaves only
        those behind, and the next run deletes them (:func:`remove_temporary_files`).
    commit: hash and fsync a finished temporary file, then rename it over its final name, so a
        reader sees the old file or the whole new one, never a part.
    durable: fsync'd, file and folder, so it survives a power cut; resume records skip that,
        as losing one only means redoing a shard.

In and out::

    write_atomically(path, data, *, durable=True)
    commit_file(temporary, path) -> (bytes, sha256)
    save_tensors(tensors, path, metadata)            # safetensors, views allowed
    sha256_file(path) -> str      file_matches(path, *, size, sha256) -> bool
    free_bytes(folder) -> int     disk_errors(folder, name)   # ENOSPC -> CacheError
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphsplit.errors import CacheError

__all__ = [
    "TEMPORARY_FILE",
    "commit_file",
    "disk_errors",
    "file_matches",
    "free_bytes",
    "fsync_folder",
    "remove_temporary_files",
    "save_tensors",
    "sha256_file",
    "temporary_path",
    "write_atomically",
]

TEMPORARY_FILE = re.compile(r"\..+\.tmp")


def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before it is committed: ``.{name}.tmp`` in the same folder."""
    return path.with_name(f".{path.name}.tmp")


def write_atomically(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The bytes go to a temporary name in the same folder and are renamed over ``path``. When
    ``durable``, the file is fsync'd before and the folder after the rename, so both survive a
    power loss.
    """
    temporary = temporary_path(path)
    with open(temporary, "wb") as handle:
        handle.write(data)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(temporary, path)
    if durable:
        fsync_folder(path.parent)


def commit_file(temporary: Path, path: Path) -> tuple[int, str]:
    """Hash and fsync a finished temporary file, then rename it into place.

    The folder is fsync'd once, before the manifest is written: until then a rename lost to a
    power cut only means the shard is redone on resume.

    Returns:
        The file's size in bytes and its hex sha256.
    """
    sha = sha256_file(temporary)
    descriptor = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        size = os.fstat(descriptor).st_size
    finally:
        os.close(descriptor)
    os.replace(temporary, path)
    return size, sha


def fsync_folder(folder: Path) -> None:
    """Make renames inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, also for views that share one storage.

    safetensors writes non-overlapping views of one storage as separate tensors; versions that
    refuse views, and views that overlap, get copies.
    """
    try:
        save_file(tensors, path, metadata=metadata)
    except RuntimeError as error:
        if "share memory" not in str(error):
            raise
        save_file({name: value.clone() for name, value in tensors.items()}, path, metadata)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, hashed from a read-only memory map (no copy)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return hashlib.sha256().hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


def file_matches(path: Path, *, size: int, sha256: str) -> bool:
    """Whether ``path`` exists with exactly this size and sha256 (unreadable: no)."""
    try:
        return path.stat().st_size == size and sha256_file(path) == sha256
    except OSError:
        return False


def free_bytes(folder: Path) -> int:
    """The bytes free on the disk holding ``folder``."""
    return shutil.disk_usage(folder).free


@contextlib.contextmanager
def disk_errors(folder: Path, name: str) -> Iterator[None]:
    """Turn a full disk (or quota) while writing ``name`` into a :class:`CacheError` with a fix."""
    try:
        yield
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheError(
                f"the disk holding {folder} ran full while writing {name}.\n  fix: free some "
                "space and rerun the same graphsplit.cache call: finished shards are kept"
            ) from error
        raise


def remove_temporary_files(*folders: Path) -> None:
    """Delete the temporary files a stopped run left in ``folders`` (missing ones are skipped)."""
    for folder in folders:
        if folder.is_dir():
            for entry in folder.iterdir():
                if TEMPORARY_FILE.fullmatch(entry.name) and entry.is_file():
                    entry.unlink()
