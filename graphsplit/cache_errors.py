"""The exceptions of graphsplit's disk side: writing, checking and reading a cache.

Every one is a :class:`graphsplit.errors.GraphsplitError` and says what went wrong, where (the
cache folder, the shard, the sample keys) and what to do about it.
"""

from __future__ import annotations

from graphsplit.errors import GraphsplitError

__all__ = [
    "CacheError",
    "CacheLockedError",
    "CorruptCacheError",
    "ManifestError",
    "StaleCacheError",
]


class CacheError(GraphsplitError):
    """A cache cannot be written or read as asked (no disk space, bad loader, mixed batch...)."""


class CacheLockedError(CacheError):
    """Another ``graphsplit.cache`` run holds the cache folder's lock."""


class ManifestError(CacheError):
    """``manifest.json`` (or a resume record) is missing, malformed or not graphsplit's."""


class CorruptCacheError(CacheError):
    """A shard is missing, has the wrong size or checksum, or does not hold what it should."""


class StaleCacheError(CacheError):
    """The cache was produced by other weights, code, boundary or data than the ones given."""
