"""Where ``graphsplit export`` writes: one safe write path, local or on an object store.

The export follows the same rules as :func:`graphsplit.cache` writing a cache folder:

Glossary:
    destination: ``out`` as given. A URL stays a URL (``s3://bucket/x`` is written to the
        bucket through fsspec); a local path that is a URL whose ``//`` was lost (``s3:/b/x``)
        is refused (:func:`~graphsplit.caching.store.remote.location`), never made a folder
        named ``s3:``.
    staging folder: a new, private (0700) folder ``.graphsplit-{name}.{pid}-{token}.tmp``
        next to a local destination (in the system's temporary folder for a remote one),
        created by ``mkdir``, which never follows a planted symlink and fails if anything is
        there. The dataset is written inside it, then renamed into place; it is removed on
        every failure, so a failed export leaves nothing behind.
    our export: what graphsplit may replace with ``overwrite=True``: a ``save_to_disk`` folder
        or parquet file whose features carry a graphsplit export record
        (:mod:`graphsplit.caching.read.hf_record`). Anything else at ``out`` (another file, a
        symlink, another dataset) is refused whatever ``overwrite`` says: graphsplit never
        deletes or overwrites a file it did not write.
    no room: ENOSPC, EDQUOT or EFBIG anywhere while writing (``datasets`` and pyarrow wrap
        them; the cause chain and message are searched): a :class:`DiskFullError`.

In and out::

    Destination.check(out, *, parquet, overwrite) -> Destination   # before any work
    destination.write(dataset) -> Path | str                        # the path, or the URL
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphsplit.caching.read.hf_record import HFExportError, is_export_record
from graphsplit.caching.store import remote
from graphsplit.caching.store.file_writes import NO_ROOM
from graphsplit.caching.store.regular_files import CLOEXEC, NOFOLLOW, open_regular
from graphsplit.caching.store.remote import RemotePath
from graphsplit.errors import DiskFullError, Fix, Remedy, UnsafeFileError, user_error
from graphsplit.units import human_bytes

__all__ = ["Destination"]

_INFO_FILE = "dataset_info.json"  # save_to_disk's: holds the features, so the record
_STATE_FILE = "state.json"  # save_to_disk's: written last, so a folder without it is unfinished
_INFO_LIMIT = 1 << 30
_STAGED = "dataset"


@dataclass(frozen=True)
class Destination:
    """A checked ``out``: local (``where`` a Path) or remote (a RemotePath)."""

    where: Path | RemotePath
    parquet: bool
    replaces: bool  # an earlier export of ours is there (overwrite=True was given)

    @classmethod
    def check(cls, out: str | os.PathLike[str], *, parquet: bool, overwrite: bool) -> Destination:
        """Refuse ``out`` unless it is free, or holds our export and ``overwrite`` is given.

        Raises:
            UnsupportedStorageError: a mangled URL, or a URL fsspec cannot open.
            HFExportError: ``out`` holds something else, or our export without ``overwrite``
                (``error.remedy`` is :attr:`Remedy.OVERWRITE`).
        """
        where = remote.location(out)
        kind = "parquet file" if parquet else "saved dataset"
        state = _remote_state(where, parquet) if isinstance(where, RemotePath) else None
        if state is None and isinstance(where, Path):
            state = _local_state(where, parquet)
        if state == "free":
            return cls(where, parquet, replaces=False)
        if state != "ours":
            raise user_error(
                HFExportError,
                f"{where} exists and is not a {kind} graphsplit may replace (it is {state}); "
                "graphsplit never deletes or overwrites what it did not write.",
                fix=Fix(f"choose a new destination, or move {where} away if it is yours"),
            )
        if not overwrite:
            raise user_error(
                HFExportError,
                f"{where} already holds an exported dataset (written by graphsplit export).",
                fix=Fix(
                    "pass {remedy} to replace it, or choose another destination",
                    Remedy.OVERWRITE,
                ),
            )
        return cls(where, parquet, replaces=True)

    def write(self, dataset: Any) -> Path | str:
        """Write ``dataset`` (a ``datasets.Dataset``) to the destination; returns its path
        (local) or URL (remote).

        Raises:
            DiskFullError: no room (the staging folder is removed); StorageError: the store
                failed; HFExportError: the destination changed since :meth:`check`.
        """
        if isinstance(self.where, RemotePath):
            with tempfile.TemporaryDirectory(prefix=".graphsplit-export.") as folder:
                staged = self._stage(dataset, Path(folder))
                self._upload(staged)
            return str(self.where)
        out = self.where
        out.parent.mkdir(parents=True, exist_ok=True)
        with _staging_folder(out) as folder:
            staged = self._stage(dataset, folder)
            self._commit(staged, folder)
        return out

    # -------------------------------------------------------------------------------- local

    def _stage(self, dataset: Any, folder: Path) -> Path:
        """Write ``dataset`` into the private ``folder``; the file or folder written."""
        staged = folder / (_STAGED + (".parquet" if self.parquet else ""))
        with _no_room(folder, self.where):
            if self.parquet:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
                with os.fdopen(os.open(staged, flags, 0o666), "wb") as handle:
                    dataset.to_parquet(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
            else:
                dataset.save_to_disk(str(staged))
                for file in sorted(staged.rglob("*")):
                    if file.is_file() and not file.is_symlink():
                        descriptor = open_regular(file)
                        try:
                            os.fsync(descriptor)
                        finally:
                            os.close(descriptor)
        return staged

    def _commit(self, staged: Path, folder: Path) -> None:
        """Rename the staged export over ``out`` (an earlier export of ours goes into the
        staging folder first, and is removed with it)."""
        out = self.where
        assert isinstance(out, Path)
        state = _local_state(out, self.parquet)
        if state != ("ours" if self.replaces else "free"):
            raise user_error(
                HFExportError,
                f"{out} changed while the dataset was written (it is now {state}); nothing "
                "was replaced.",
                fix=Fix("run the export again"),
            )
        if self.parquet:
            os.replace(staged, out)  # a rename replaces a file itself, never through a link
        else:
            if self.replaces:
                os.rename(out, folder / "replaced")
            try:
                os.rename(staged, out)
            except OSError:
                if self.replaces:
                    os.rename(folder / "replaced", out)
                raise
        _fsync_folder(out.parent)

    # ------------------------------------------------------------------------------- remote

    def _upload(self, staged: Path) -> None:
        """Upload the staged export; a folder's ``state.json`` last (a folder without it is
        not loadable, so an interrupted upload is never taken for a whole one), then remove
        files of a replaced export that the new one lacks."""
        where = self.where
        assert isinstance(where, RemotePath)
        if self.parquet:
            remote.upload(staged, where, "")
            return
        files = sorted(
            (file for file in staged.rglob("*") if file.is_file()),
            key=lambda file: (file.name == _STATE_FILE, file.name == _INFO_FILE, str(file)),
        )
        names = {file.relative_to(staged).as_posix() for file in files}
        old = set(remote.list_files(where)) if self.replaces else set()
        if self.replaces:
            remote.remove(where / _STATE_FILE)  # the old export is unloadable while it changes
        for file in files:
            remote.upload(file, where / file.relative_to(staged).as_posix(), "")
        for name in sorted(old - names):
            remote.remove(where / name)


# ---------------------------------------------------------------------------- what is there


def _local_state(out: Path, parquet: bool) -> str:
    """ "free", "ours", or what else is at ``out`` (for the message)."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return "free"
    if stat.S_ISLNK(mode):
        return "a symlink (graphsplit never writes through one)"
    if parquet:
        if not stat.S_ISREG(mode):
            return "not a regular file"
        return (
            "ours"
            if _parquet_is_ours(lambda: os.fdopen(open_regular(out), "rb"))
            else ("a file without graphsplit's export record")
        )
    if not stat.S_ISDIR(mode):
        return "not a folder"
    try:
        info = _read_limited(out / _INFO_FILE)
    except (OSError, UnsafeFileError):
        info = None
    if info is None or not (out / _STATE_FILE).is_file() or not _info_is_ours(info):
        return "a folder without graphsplit's export record"
    return "ours"


def _remote_state(where: RemotePath, parquet: bool) -> str:
    try:
        size = remote.size(where)
        folder = False
    except UnsafeFileError:  # a prefix (a folder) stands there
        size, folder = None, True
    if parquet:
        if folder:
            return "a folder"
        if size is None:
            return "free"
        opener = lambda: where.fs.open(where.path, "rb")  # noqa: E731
        return "ours" if _parquet_is_ours(opener) else "a file without graphsplit's record"
    if size is not None:
        return "a file, not a folder"
    if not folder:
        return "free"
    names = remote.list_files(where)
    if _INFO_FILE not in names or _STATE_FILE not in names:
        return "a folder without graphsplit's export record"
    info = remote.read_bytes(where / _INFO_FILE, limit=_INFO_LIMIT)
    return "ours" if _info_is_ours(info) else "a folder without graphsplit's export record"


def _read_limited(path: Path) -> bytes | None:
    descriptor = open_regular(path)
    try:
        if os.fstat(descriptor).st_size > _INFO_LIMIT:
            return None
        with os.fdopen(os.dup(descriptor), "rb") as handle:
            return handle.read()
    finally:
        os.close(descriptor)


def _info_is_ours(data: bytes) -> bool:
    """Whether ``dataset_info.json``'s bytes hold features whose ``key`` carries our record."""
    try:
        info = json.loads(data)
        key = info["features"]["key"]
    except (ValueError, RecursionError, KeyError, TypeError):
        return False
    return isinstance(key, dict) and is_export_record(key.get("id"))


def _parquet_is_ours(opener: Any) -> bool:
    """Whether the parquet file ``opener()`` opens has our record in its schema's features."""
    import pyarrow.parquet as pq

    try:
        with opener() as handle:
            metadata = pq.read_schema(handle).metadata or {}
        info = json.loads(metadata.get(b"huggingface", b"{}"))
        key = info["info"]["features"]["key"]
    except Exception:  # not parquet, no metadata, not ours: pyarrow raises its own types
        return False
    return isinstance(key, dict) and is_export_record(key.get("id"))


# -------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _staging_folder(out: Path) -> Iterator[Path]:
    """A new private folder next to ``out``, removed afterwards whatever happens."""
    folder = out.with_name(f".graphsplit-{out.name}.{os.getpid()}-{secrets.token_hex(8)}.tmp")
    with _no_room(out.parent, out):
        os.mkdir(folder, 0o700)  # fails on anything planted there; never follows a link
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # rmtree does not follow links inside


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY | CLOEXEC)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _room_error(error: BaseException) -> int | None:
    """The "no room" errno in ``error`` or its causes (pyarrow and ``datasets`` wrap it, and
    sometimes keep only the message)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return error.errno
        text = str(error)
        for code in NO_ROOM:
            if os.strerror(code) in text:
                return code
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def _no_room(folder: Path, out: Path | RemotePath) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        code = _room_error(error)
        if code is None:
            raise
        try:
            free = f", {human_bytes(shutil.disk_usage(folder).free)} free"
        except OSError:
            free = ""
        raise user_error(
            DiskFullError,
            f"no room to write the export {out} (staged in {folder}): the disk is full, or a "
            f"quota or the file size limit was reached ({os.strerror(code)}{free}). Nothing "
            "half-written was kept, and an earlier export there is unchanged.",
            fix=Fix("free some space (or raise the limit) and run the export again"),
        ) from None
