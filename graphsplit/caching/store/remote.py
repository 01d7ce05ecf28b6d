"""Caches on fsspec filesystems (``s3://``, ``gs://``, ``hf://``, ...): where a cache lives,
and the few operations graphsplit needs from an object store.

Glossary:
    location: what a user's path names: a local folder (a ``pathlib.Path``; ``file://`` URLs
        are local folders too, with every local guarantee) or a :class:`RemotePath`.
    object store: S3, GCS, the Hub, ...: no rename, no append, no ``flock``, but an object
        written by one put (single or multipart) becomes visible whole, or not at all, and
        reads after a write see it (S3 and GCS are strongly consistent).
    staging file: where a file bound for a remote cache is serialised before its upload: a
        local temporary file in a private ``$TMPDIR/graphsplit-upload-*/`` folder, deleted
        once uploaded (the folder when the process exits).
    storage error: the store refused or failed a request (credentials, network, a missing
        bucket): a :class:`~graphsplit.errors.StorageError` naming the URL and the fix.

Every write to a remote cache is a whole-object put, so the rules of the local format hold
without rename: a shard is uploaded whole before its progress record, the progress records
before the manifest, and the manifest last (see :mod:`graphsplit.caching.format.layout`).

In and out::

    location(path) -> Path | RemotePath    # UnsupportedStorageError for what fsspec cannot open
    RemotePath / name, .name, .parent, str() -> the URL
    put_bytes(path, data, *, exclusive=False)    upload(staged, path, checksum) -> (size, checksum)
    size(path) -> int | None    read_bytes(path, *, limit)    # ranged reads: pinned_object
    download(path, local)
    checksum(path, algorithm)   exists(path)    list_files(folder)    remove(path)
    version(path) -> str | None     version_of(info) -> str | None     # the object's ETag
    storage_requests(path, action)  # a context turning a failed request into a StorageError
    make_folder(path)           staging_path(path) -> Path
    @or_remote(remote_function)  # how caching.store.file_writes sends a RemotePath here
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from graphsplit.caching.format.checksums import Running
from graphsplit.caching.format.records import DAMAGED_FILE_FIX
from graphsplit.errors import (
    Fix,
    GraphsplitError,
    StorageError,
    UnsafeFileError,
    UnsupportedStorageError,
    user_error,
)
from graphsplit.units import human_bytes

__all__ = [
    "RemotePath",
    "checksum",
    "download",
    "exists",
    "list_files",
    "location",
    "make_folder",
    "nothing",
    "or_remote",
    "put_bytes",
    "read_bytes",
    "read_prefix",
    "remove",
    "size",
    "staging_path",
    "storage_requests",
    "upload",
    "version",
    "version_of",
]

# "s3:" at the start of a local path: a URL whose "//" pathlib collapsed (Path("s3://b/c") is
# "s3:/b/c"), or a URL typed with one slash. One-letter schemes are Windows drives.
_MANGLED_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/+(.*)")
_LOCAL_PROTOCOLS = {"file", "local"}
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub"}
_CHUNK = 8 << 20


class RemotePath:
    """A file or folder on an fsspec filesystem, spelled like a ``pathlib.Path``.

    ``fs`` is the filesystem, ``path`` the name fsspec uses (no protocol); ``str()`` gives the
    URL, for messages. It has no ``__fspath__``: an ``os`` call on it fails loudly instead of
    creating a local file with a URL's name. In a forked process (a DataLoader worker) ``fs``
    is rebuilt from its options: fsspec's async filesystems (s3fs, gcsfs) are not fork-safe.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self._fs = fs
        self._pid = os.getpid()
        self.path = path.rstrip("/")

    @property
    def fs(self) -> Any:
        if self._pid != os.getpid():
            self._fs = type(self._fs)(**self._fs.storage_options)
            self._pid = os.getpid()
        return self._fs

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.fs, f"{self.path}/{name}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, self.path.rsplit("/", 1)[0])

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (self.fs, self.path) == (other.fs, other.path)

    def __hash__(self) -> int:
        return hash(self.path)


def location(path: str | os.PathLike[str] | RemotePath) -> Path | RemotePath:
    """Where ``path`` names a cache: a local folder, or a folder on an fsspec filesystem.

    Raises:
        UnsupportedStorageError: a URL fsspec cannot open (unknown protocol, its package not
            installed), or a local path that is a mangled URL (``s3:/bucket``): never a local
            folder with a URL's name.
    """
    if isinstance(path, RemotePath):
        return path
    text = os.fspath(path)
    if "://" not in text:
        mangled = _MANGLED_URL.fullmatch(text)
        if mangled:
            scheme, rest = mangled.groups()
            raise user_error(
                UnsupportedStorageError,
                f"the cache path {text!r} looks like a URL whose '//' was lost (a pathlib.Path "
                f"turns {scheme}://{rest} into {scheme}:/{rest}); graphsplit does not create a "
                f"local folder named {scheme}:.",
                fix=Fix(
                    f"pass the URL as a string, '{scheme}://{rest}', or './{text}' if you mean a "
                    "local folder"
                ),
            )
        return Path(text)
    import fsspec

    protocol = text.split("://", 1)[0].split("::")[-1].lower()
    try:
        fs, root = fsspec.url_to_fs(text)
    except ImportError as error:
        package = _PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        raise user_error(
            UnsupportedStorageError,
            f"cannot open the cache URL {text}: {protocol}:// needs a package that is not "
            f"installed ({error}).",
            fix=Fix(f"pip install {package}"),
        ) from None
    except (ValueError, TypeError) as error:
        raise user_error(
            UnsupportedStorageError,
            f"cannot open the cache URL {text}: fsspec does not know it ({error}).",
            fix=Fix(
                "use a local path or a URL of a filesystem fsspec knows (s3://, gs://, hf://, "
                "file://)"
            ),
        ) from None
    fs.invalidate_cache()  # another process may have written since this instance listed
    if set(_protocols(fs)) & _LOCAL_PROTOCOLS:
        return Path(root)  # file:// is a local folder: flock, fsync, rename all apply
    if not root.strip("/"):
        raise user_error(
            UnsupportedStorageError,
            f"the cache URL {text} names no folder.",
            fix=Fix(
                f"add one, e.g. {text.rstrip('/')}/my-cache (a cache never takes a whole bucket)"
            ),
        )
    return RemotePath(fs, root)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


@contextlib.contextmanager
def _requests(path: RemotePath, action: str) -> Iterator[None]:
    """Turn a failed request into a StorageError naming the URL; FileNotFoundError and
    FileExistsError pass through (callers decide what they mean)."""
    try:
        yield
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise  # a local disk is full (a download): the caller names it
        _raise_storage_error(path, action, error)
    except GraphsplitError:
        raise
    except Exception as error:  # fsspec maps most failures to OSError, but not all (botocore)
        _raise_storage_error(path, action, error)


storage_requests = _requests  # for the store's other modules (pinned reads)


def _raise_storage_error(path: RemotePath, action: str, error: Exception) -> None:
    if isinstance(error, PermissionError):
        raise user_error(
            StorageError,
            f"the store refused to {action} {path} ({error}).",
            fix=Fix(
                "check the credentials (for S3: AWS_ACCESS_KEY_ID / AWS_PROFILE, and "
                "AWS_ENDPOINT_URL for another server) and that they may read and write that "
                "prefix"
            ),
        ) from None
    raise user_error(
        StorageError,
        f"could not {action} {path} ({type(error).__name__}: {error}).",
        fix=Fix(
            "check the network and the store, then rerun the same call: a cache run resumes from "
            "the shards already uploaded"
        ),
    ) from None


def or_remote(remote_function: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """Decorate a local file operation (:mod:`graphsplit.caching.store.file_writes`,
    :mod:`graphsplit.caching.store.regular_files`) so that a call whose first argument is a
    :class:`RemotePath` goes to ``remote_function`` instead."""

    def wrap(local_function: Callable) -> Callable:
        @functools.wraps(local_function)
        def either(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, RemotePath):
                return remote_function(path, *args, **kwargs)
            return local_function(path, *args, **kwargs)

        return either

    return wrap


def nothing(*args: Any, **kwargs: Any) -> None:
    """What an object store needs instead of a folder fsync or a free-space check: nothing."""


# ------------------------------------------------------------------------------------ writing


def put_bytes(path: RemotePath, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` as the whole object ``path`` (visible whole or not at all).

    Raises:
        FileExistsError: ``exclusive`` and the object exists (a conditional create: atomic
            on S3, see the lock's docs for other stores); StorageError.
    """
    with _requests(path, "write"):
        path.fs.pipe_file(path.path, data, mode="create" if exclusive else "overwrite")


def staging_path(path: RemotePath) -> Path:
    """The local staging file of ``path`` (unique per process and URL, see the glossary)."""
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    return _staging_folder() / f".{digest}-{path.name}.tmp"


_STAGING: dict[int, Path] = {}  # this process's staging folder (a forked child makes its own)


def _staging_folder() -> Path:
    """A private folder (``mkdtemp``: a fresh name, mode 0o700, never a planted one) for this
    process's staging files, removed when the process exits normally."""
    folder = _STAGING.get(os.getpid())
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="graphsplit-upload-"))
        _STAGING[os.getpid()] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def upload(staged: Path, path: RemotePath, checksum: str) -> tuple[int, str]:
    """Upload the finished staging file ``staged`` as ``path``, then delete it.

    Returns:
        The file's size in bytes and ``checksum`` (computed while it was written).
    """
    try:
        size = os.stat(staged).st_size
        with _requests(path, "upload"):
            path.fs.put_file(str(staged), path.path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)
    return size, checksum


def make_folder(path: RemotePath) -> None:
    """Check that the cache can live at ``path``: its bucket exists (graphsplit never creates
    buckets); on stores with real folders, create them."""
    fs = path.fs
    with _requests(path, "open"):
        if hasattr(fs, "split_path"):  # a bucket store (s3fs, gcsfs): folders are prefixes
            bucket = fs.split_path(path.path)[0]
            if not fs.exists(bucket):
                raise user_error(
                    StorageError,
                    f"the bucket {bucket!r} of the cache URL {path} does not exist, or these "
                    "credentials cannot see it, or the store cannot be reached.",
                    fix=Fix(
                        "create the bucket first (graphsplit never does), or check the URL, the "
                        "endpoint (AWS_ENDPOINT_URL) and the credentials"
                    ),
                )
        else:
            fs.makedirs(path.path, exist_ok=True)
        if fs.isfile(path.path):
            raise user_error(
                StorageError,
                f"the cache URL {path} names an existing file, not a folder.",
                fix=Fix("pass the URL of a folder (a prefix), or delete the file"),
            )


def remove(path: RemotePath) -> None:
    """Delete the object ``path`` if it exists."""
    with contextlib.suppress(FileNotFoundError), _requests(path, "delete"):
        path.fs.rm_file(path.path)


# ------------------------------------------------------------------------------------ reading


def size(path: RemotePath) -> int | None:
    """The size of the object ``path``, or None when there is none.

    Raises:
        UnsafeFileError: a folder (a prefix) stands where a file should be.
    """
    try:
        with _requests(path, "read"):
            _forget_listings(path)
            info = path.fs.info(path.path)
    except FileNotFoundError:
        return None
    if info.get("type") != "file":
        raise user_error(
            UnsafeFileError,
            f"{path} is a folder, not what graphsplit wrote there; graphsplit reads and writes "
            "only the files it wrote in the cache folder.",
            fix=Fix(f"delete {path} (or the whole cache) and rerun graphsplit.cache"),
        )
    return int(info["size"])


# What identifies one version of an object, by store: S3's ETag (s3fs), GCS's etag (gcsfs).
_VERSION_KEYS = ("ETag", "etag")


def version_of(info: Any) -> str | None:
    """The version of an object (its ETag) in fsspec's ``info`` of it; None where the store
    reports none (its objects are then checked by size and checksum only)."""
    for key in _VERSION_KEYS:
        value = info.get(key) if isinstance(info, dict) else None
        if isinstance(value, str) and value:
            return value
    return None


def version(path: RemotePath) -> str | None:
    """The version (ETag) of the object ``path`` now, asked of the store (not a cached
    listing); None where the store reports none or there is no object."""
    try:
        with _requests(path, "read"):
            _forget_listings(path)
            return version_of(path.fs.info(path.path))
    except FileNotFoundError:
        return None


def exists(path: RemotePath) -> bool:
    """Whether an object (or a folder) ``path`` exists."""
    with _requests(path, "read"):
        _forget_listings(path)
        return bool(path.fs.exists(path.path))


def _forget_listings(path: RemotePath) -> None:
    """Drop fsspec's cached listings of ``path``'s folders: another process (a rank of the
    same run, a resumed run) may have written there since, and a cached listing would answer
    "no such file" without asking the store."""
    path.fs.invalidate_cache(path.path)


def read_bytes(path: RemotePath, *, limit: int) -> bytes:
    """The bytes of the object ``path``, refused above ``limit`` bytes.

    Raises:
        FileNotFoundError; UnsafeFileError: a folder, or larger than ``limit``.
    """
    found = size(path)
    if found is None:
        raise FileNotFoundError(str(path))
    if found > limit:
        raise user_error(
            UnsafeFileError,
            f"{path} holds {human_bytes(found)}, more than the {human_bytes(limit)} a graphsplit "
            "cache file of its kind can hold.",
            fix=DAMAGED_FILE_FIX,
        )
    with _requests(path, "read"):
        return bytes(path.fs.cat_file(path.path))


def read_prefix(path: RemotePath, count: int) -> bytes:
    """The first ``count`` bytes of the object ``path`` (fewer if it is shorter): enough to
    recognise a file by its opening, without reading the whole of it."""
    with _requests(path, "read"):
        return bytes(path.fs.cat_file(path.path, start=0, end=count))


def download(path: RemotePath, local: Path) -> None:
    """Copy the object ``path`` to the local file ``local`` (which the caller checks)."""
    with _requests(path, "download"):
        path.fs.get_file(path.path, str(local))


def checksum(path: RemotePath, algorithm: str) -> str:
    """The checksum of the object's bytes, streamed in 8 MiB pieces (nothing kept)."""
    running = Running(algorithm)
    with _requests(path, "read"), path.fs.open(path.path, "rb", block_size=_CHUNK) as handle:
        while piece := handle.read(_CHUNK):
            running.update(piece)
    return running.checksum()


def list_files(folder: RemotePath) -> list[str]:
    """The names of the objects directly in ``folder`` (none when it does not exist)."""
    try:
        with _requests(folder, "list"):
            entries = folder.fs.ls(folder.path, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    return sorted(
        entry["name"].rstrip("/").rsplit("/", 1)[-1]
        for entry in entries
        if entry.get("type") == "file"
    )
