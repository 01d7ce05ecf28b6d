"""The disk side: run stage 1 over a dataset into a cache folder, and train stage 2 from it.

``cache`` writes; ``CachedDataset`` reads; ``check_cache`` audits. The modules, in the order a
cache is written and read:

    run           cache(): fingerprint, decide, write shards, finish
    fingerprint   what produced a cache, to compare it with a split
    decide        nothing to do, resume, or start afresh; removing graphsplit's files
    samples       whether the loader still yields the cached samples (keys, input digests)
    lock          the folder lock (flock)
    remote_lock   the lock of a cache on an object store (a conditionally created object)
    sources       where batches come from (the loader, numbered)
    shards        where a shard is written (stage 1, rows, background save and commit)
    processes     agreeing across accelerate processes
    format        the folder's files and records, described once
    validate      strict JSON to the format's dataclasses and back
    files         every read and write: atomic, fsync'd, regular files only, no room -> error
    remote        caches on fsspec filesystems (s3://, gs://, hf://): the same operations
    tensor_file   the safetensors format, written and read without the library
    ranged        a remote shard read by byte ranges
    read_through  verified local copies of a remote cache's shards (local_cache=)
    memory_order  the memory layout rows are stored in
    dataset       CachedDataset, collate, verify_inputs
    check         check_cache, CacheReport
"""

from graphsplit.caching.read.check import CacheReport, check_cache
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset, verify_inputs
from graphsplit.caching.write.cache_run import CacheInfo, cache

__all__ = [
    "CacheInfo",
    "CacheReport",
    "CachedDataset",
    "cache",
    "check_cache",
    "collate",
    "verify_inputs",
]
