"""graphsplit's exceptions and the one helper that formats every user-facing error.

Every error a user can fix names four things: the graph node, the user's source line, the
reason, and the fix. :func:`user_error` builds that message so all of them read alike.
"""

from __future__ import annotations

import torch.fx

__all__ = [
    "CacheError",
    "CacheLockedError",
    "CorruptCacheError",
    "DiskFullError",
    "GraphsplitError",
    "ManifestError",
    "MetaParameterError",
    "SplitError",
    "StaleCacheError",
    "TornFileError",
    "TraceError",
    "UnsafeFileError",
    "VerifyError",
    "user_error",
]


class GraphsplitError(Exception):
    """Base class of every error graphsplit raises on purpose."""


class TraceError(GraphsplitError):
    """The training step cannot be traced into a graph that is valid for every batch."""


class SplitError(GraphsplitError):
    """The traced step cannot be cut into two exact stages (or the arguments are invalid)."""


class VerifyError(GraphsplitError, AssertionError):
    """The split stages do not reproduce the model's outputs or gradients."""


class MetaParameterError(GraphsplitError):
    """A stage was called while it holds a parameter or buffer on the ``meta`` device."""


# -- the disk side: writing, checking and reading a cache ---------------------------------------
# Each says what went wrong, where (the cache folder, the shard, the sample keys) and what to do.
class CacheError(GraphsplitError):
    """A cache cannot be written or read as asked (no disk space, bad loader, mixed batch...)."""


class CacheLockedError(CacheError):
    """Another ``graphsplit.cache`` run holds the cache folder's lock."""


class ManifestError(CacheError):
    """``manifest.json`` (or a resume record) is missing, malformed or not graphsplit's."""


class TornFileError(ManifestError):
    """A record of the cache is empty or not JSON at all: a write cut short (by a power cut
    before graphsplit fsync'd its records) rather than a file of another kind."""


class CorruptCacheError(CacheError):
    """A shard is missing, has the wrong size or checksum, or does not hold what it should."""


class StaleCacheError(CacheError):
    """The cache was produced by other weights, code, boundary or data than the ones given."""


class UnsafeFileError(CorruptCacheError):
    """A file of the cache folder is not a regular file inside it (a symlink, FIFO, device or
    folder), so graphsplit neither reads nor writes through it."""


class DiskFullError(CacheError):
    """The disk (or a quota, or the file size limit) had no room for a file of the cache; the
    run can be resumed once there is room."""


def describe_node(node: torch.fx.Node) -> str:
    """``name = target(args)`` in fx's own notation, short enough for one line."""
    text = node.format_node() or node.name
    text = text.strip().removeprefix("%")
    return text if len(text) <= 160 else text[:157] + "..."


def user_error(
    error_type: type[GraphsplitError],
    reason: str,
    *,
    fix: str,
    node: torch.fx.Node | None = None,
    source: str | None = None,
) -> GraphsplitError:
    """Build an error whose message names the node, the user's source line, the reason and fix.

    ``source`` defaults to the ``file:line`` graphsplit recorded for ``node`` while tracing.
    """
    if source is None and node is not None:
        source = node.meta.get("source")
        code = node.meta.get("source_code")
        if source and code:
            source = f"{source}  {code}"
    lines = [reason]
    if node is not None:
        lines.append(f"  node:   {describe_node(node)}")
    if source:
        lines.append(f"  source: {source}")
    lines.append(f"  fix:    {fix}")
    return error_type("\n".join(lines))


# storage errors
# -- caches on fsspec filesystems (s3://, gs://, hf://): see graphsplit.caching.remote ---------
class UnsupportedStorageError(CacheError):
    """A cache path graphsplit cannot open: a URL fsspec does not know or lacks the package
    for, or a local path that is a URL whose '//' was lost."""


class StorageError(CacheError):
    """A remote store refused or failed a request (credentials, network, a missing bucket)."""


__all__ += ["StorageError", "UnsupportedStorageError"]
