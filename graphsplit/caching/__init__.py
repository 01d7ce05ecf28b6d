"""The disk side: run stage 1 over a dataset into a cache folder, and train stage 2 from it.

``cache`` writes; ``CachedDataset`` reads; ``check_cache`` audits. See
:mod:`graphsplit.caching.format` for what a cache folder holds.
"""

from graphsplit.caching.dataset import (
    CachedDataset,
    CacheReport,
    check_cache,
    collate,
    verify_inputs,
)
from graphsplit.caching.run import CacheInfo, cache

__all__ = [
    "CacheInfo",
    "CacheReport",
    "CachedDataset",
    "cache",
    "check_cache",
    "collate",
    "verify_inputs",
]
