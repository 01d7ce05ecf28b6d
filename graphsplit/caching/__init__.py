"""The disk side: run stage 1 over a dataset into a cache folder, and train stage 2 from it.

``cache`` writes; ``CachedDataset`` reads; ``check_cache`` audits. Its rooms, bottom up (a
module imports only from its own room and the rooms below, see ``tests/test_layout.py``):

    format/   pure descriptions, no I/O
        layout            the folder's file names and records (manifest, resume header, progress)
        records           strict JSON to the records' dataclasses and back, driven by their fields
        record_documents  each record file's bytes, and its rules across fields
        checksums         the checksums files are recorded by (xxh3; sha256 of format 1)
        fingerprint       what produced a cache (code, weights, boundary, versions), compared
        input_digests     what a sample's stage-1 inputs were, one digest per sample
        tensor_file       the safetensors format, written and read without the library
        shard_header      a shard's safetensors header against the manifest's record of it
        memory_order      the memory layout rows are stored in
    store/    where the bytes live
        file_writes       every write: atomic, fsync'd, through no symlink, no room -> error
        regular_files     every read: regular files only, pinned names, checksums of files
        record_files      the records on disk: the manifest, resume header, progress records
        durability        caches written without fsyncs (durable=False) and machine restarts
        lock              the folder lock (flock)
        remote            caches on fsspec filesystems (s3://, gs://, hf://): the same operations
        remote_lock       the lock of a cache on an object store (a conditionally created object)
        ranged            a remote shard read by byte ranges
        read_through      checksummed local copies of a remote cache's shards (local_cache=)
        mapped            a local shard's rows as views of its memory map
    loader/   where batches come from
        batches           the user's loader, numbered: batches, their keys and positions
        samples           whether the loader still yields the cached samples (keys, digests)
    write/    cache()
        cache_run         cache(): fingerprint, folder decision, write shards, finish
        live_writer       the push-style writer a live cache hands each batch's boundary
        folder_decision   nothing to do, resume, or start afresh; removing graphsplit's files
        shards            where a shard is written (stage 1, rows, background save and commit)
        processes         agreeing across accelerate processes
    read/     reading a cache back
        dataset           CachedDataset, verify_inputs
        collation         collate and the items it batches (CachedSample)
        bucket_sampler    BucketBatchSampler: batches of one shape, seeded, resumable, sharded
        whole_batches     WholeBatchSampler: a paired cache's stage-1 batches, whole
        stale_split       refuse_other_split: is the cache this split's
        audit             check_cache, CacheReport
        hf_export         a cache as a Hugging Face dataset, and back
    live          LiveCache: cache while training (the first epoch writes, later ones read)

Vocabulary: five ways the disk side checks something, each with its own word.
    audit: ``check_cache(path)`` reads every byte of a cache and lists each damaged file and
        the samples it holds (:class:`CacheReport`); it never raises for damage.
    strict reading: every record is read field by field against its dataclass and the rules
        across fields (:mod:`~graphsplit.caching.format.records`,
        :mod:`~graphsplit.caching.format.record_documents`); anything else is a
        ``ManifestError`` naming the file and field. (Older names: "validate".)
    checksum on first open: ``CachedDataset(verify=True)`` hashes each shard the first time
        it is opened and compares the manifest's checksum (``_checksummed`` shards); without
        it only the size and the safetensors header are compared (a "problem" of the file).
    input digests: ``verify_inputs(cached, dataset)`` (and ``CachedDataset(dataset=)``)
        rehashes every dataset item's stage-1 inputs and compares them with the digests
        recorded per sample; ``cache()`` does the same with the loader's batches on resume.
    staleness: a cache made from other frozen weights, stage-1 code or boundary than a split
        (the fingerprint tells), or holding other sample keys, is refused with a
        ``StaleCacheError`` (``refuse_other_split``, ``refuse_other_fingerprints``...);
        a function named ``refuse_*`` raises when something must stop the call.
A "run" on this side is one call of ``cache()`` (the ``cache_run``); running stage 1 over a
batch is "computing" it.
"""

from graphsplit.caching.live import LiveCache
from graphsplit.caching.read.audit import CacheReport, check_cache
from graphsplit.caching.read.bucket_sampler import BucketBatchSampler
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset, verify_inputs
from graphsplit.caching.write.cache_run import CacheInfo, cache

__all__ = [
    "BucketBatchSampler",
    "CacheInfo",
    "CacheReport",
    "CachedDataset",
    "LiveCache",
    "cache",
    "check_cache",
    "collate",
    "verify_inputs",
]
