"""Read a cache written by :func:`graphsplit.cache` and refuse a stale one.

Glossary:
    item: one sample of a :class:`CachedDataset`: ``{"key": str, name: row tensor, ...}`` for
        the boundary tensors that have a batch dim, in their storage dtype.
    constants: the boundary tensors without a batch dim, stored once;
        :func:`~graphsplit.caching.read.collation.collate` adds them to every batch.
    stale: made from other frozen weights, stage-1 code or boundary than a given split (the
        fingerprint tells), or from other inputs than a given dataset (the input digests tell).
    checksum on first open: ``verify=True`` hashes each shard the first time it is opened
        (the shards in ``_checksummed`` are done); a damaged one is refused with the samples
        it holds, the others still read.

In and out::

    CachedDataset(path, split=None, *, dataset=None, expected_keys=None, verify=True)
        cached[i] -> CachedSample    cached.shapes(i) -> {name: shape}    cached.buckets()
        cached.paired_rows -> PairedRows | None    cached.stage1_batches -> ((index, ...), ...)
        cached.loader(batch_size, *, shuffle=True, seed=0, drop_last=False, num_replicas=None,
                      rank=None, **loader_options) -> BucketLoader   # batches of one shape
    verify_inputs(cached, dataset) -> None         # raises StaleCacheError naming changed keys
    refuse_other_split(manifest, current, path, paired=None)   # caching.read.stale_split's

Nothing here unpickles: each shard is opened once, its size, checksum and header checked by
the one strict reader of the format (:mod:`graphsplit.caching.read.audit`), and read from its
memory map (:mod:`graphsplit.caching.store.mapped`); an item's tensors are copies of its rows,
so an item changed in place (``item["latents"].mul_(0)``) changes nothing a later read returns
(the cost, measured by ``benchmarks/bench_safe_items.py``, is in docs/benchmarks.md), and the
manifest is read strictly. Batching items is
:mod:`graphsplit.caching.read.collation`; auditing a whole cache is
:mod:`graphsplit.caching.read.audit`.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphsplit.caching.format.fingerprint import fingerprint, in_terms_of
from graphsplit.caching.format.input_digests import item_input_digest
from graphsplit.caching.format.layout import ConstantsRecord, FileRecord, Manifest, tensor_name
from graphsplit.caching.format.memory_order import inverse, row_order
from graphsplit.caching.format.records import REBUILD
from graphsplit.caching.loader.samples import describe_changes
from graphsplit.caching.read.audit import open_problem
from graphsplit.caching.read.bucket_sampler import BucketBatchSampler, BucketLoader
from graphsplit.caching.read.collation import (
    CachedSample,
    Collation,
    bucket_key,
    collate,
    padded_dims,
    sample_signatures,
)
from graphsplit.caching.read.stale_split import refuse_other_split
from graphsplit.caching.read.whole_batches import paired_sampler, stage1_batches
from graphsplit.caching.store.durability import restart_cause, restarted_since
from graphsplit.caching.store.read_through import LocalCopies
from graphsplit.caching.store.record_files import read_manifest
from graphsplit.caching.store.remote import RemotePath, location
from graphsplit.errors import (
    CacheError,
    CorruptCacheError,
    Fix,
    GraphsplitError,
    Remedy,
    StaleCacheError,
    StorageError,
    user_error,
)
from graphsplit.units import some_keys

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["CachedDataset", "refuse_other_split", "verify_inputs"]

_MAX_OPEN_SHARDS = 64


class CachedDataset(torch.utils.data.Dataset):
    """A map-style dataset over a cache folder; item ``i`` is sample ``i``'s rows.

    Shards are opened lazily and memory-mapped (at most 64 at a time per process; a forked
    DataLoader worker keeps the ones already open); an item's tensors are its own copies of
    the rows, so writing into an item in place changes neither the file nor what the next
    epoch reads. Unless ``verify=False``, each shard is checked against
    its checksum the first time it is opened: a damaged shard raises :class:`CorruptCacheError`
    naming it and its samples, while the other shards still read.

    A cache on an fsspec filesystem (``"s3://bucket/cache"``, ``"gs://..."``, ``"hf://..."``)
    is read by byte ranges (each shard's header once, then one request per tensor; nothing is
    mapped), or, with ``local_cache``, through a local read-through copy of each shard.

    Args:
        path: the cache folder, or its URL.
        split: when given, refuse a cache made from other frozen weights, stage-1 code or
            boundary (:class:`StaleCacheError` naming what differs); other library versions
            only warn.
        dataset: when given, rehash every item's stage-1 inputs and refuse a cache whose
            samples changed, were added or were removed (reads the whole dataset once; see
            :func:`verify_inputs`).
        expected_keys: when given, refuse a cache whose sample keys are not exactly these
            (a cheap check for added or removed samples).
        verify: check each shard's checksum on first use (reads each shard once more). With
            ``verify=False`` each shard's size, tensor names, shapes and dtypes, and the sample
            keys written inside it are still checked against the manifest (cheap: its header
            only), so a truncated or swapped shard is refused; changed bytes inside a tensor
            are found only by the checksum (or :func:`graphsplit.check_cache`). On an object
            store without ``local_cache`` the checksum streams each shard once per process.
            A cache written with ``cache(..., durable=False)`` is verified regardless once
            the machine that wrote it has restarted (a power cut may have lost its bytes);
            running ``cache`` again verifies it once and records it as durable.
        local_cache: for a remote cache, a local folder to keep checksummed copies of its shards
            in (:mod:`graphsplit.caching.store.read_through`), downloaded on first use and then
            memory-mapped: the fast way to train from a bucket. Ignored for a local cache.

    Example:
        >>> import tempfile, graphsplit
        >>> from graphsplit.caching.write.cache_run import cache
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> _ = model[0].requires_grad_(False)  # frozen: its output is cached
        >>> split = graphsplit.split(model, args=(torch.randn(2, 4),))
        >>> data = [{"input": torch.randn(4)} for _ in range(6)]
        >>> path = tempfile.mkdtemp()
        >>> _ = cache(split, torch.utils.data.DataLoader(data, batch_size=2), path, progress=False)
        >>> cached = CachedDataset(path, split)
        >>> loader = cached.loader(batch_size=3, seed=0)  # batches of one shape, shuffled
        >>> split.stage2(**next(iter(loader))).shape
        torch.Size([3, 1])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        split: Split | None = None,
        *,
        dataset: Any = None,
        expected_keys: Iterable[Any] | None = None,
        verify: bool = True,
        local_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = location(path)
        self.manifest: Manifest = read_manifest(self.path)
        self._copies: LocalCopies | None = None
        if local_cache is not None and isinstance(self.path, RemotePath):
            self._copies = LocalCopies(local_cache)
        # Unsynced and written before a restart: no file is trusted before its checksum.
        self.verify = verify or restarted_since(self.manifest)
        header = self.manifest.header
        self.boundary = {spec.name: spec for spec in header.boundary}
        self.keys: list[str] = [key for shard in self.manifest.shards for key in shard.keys]
        self._starts: list[int] = [0]
        for shard in self.manifest.shards:
            self._starts.append(self._starts[-1] + len(shard.keys))
        self._sample_names = tuple(spec.name for spec in header.sample_specs)
        most_rows = max((len(shard.keys) for shard in self.manifest.shards), default=0)
        self._tensor_names = [
            tuple(zip(self._sample_names, [tensor_name(row, n) for n in self._sample_names]))
            for row in range(most_rows)
        ]
        self._handles: dict[int, Any] = {}
        self._checksummed: set[int] = set()
        self._corrupt: dict[int, str] = {}
        # Each sample's plan (signature key) in a cache of several plans; else None.
        self.signatures: list[str | None] = sample_signatures(self.manifest)
        if split is not None and self.manifest.plans and getattr(split, "plan_set", None):
            for key, record in self.manifest.plans.items():
                split.plan_set.know(key, record.signature, record.example or None)
        if split is not None:
            cached = self.manifest.header.fingerprint
            current = in_terms_of(fingerprint(split, allow_meta=True), cached, split)
            paired = getattr(split, "paired_rows", None)
            refuse_other_split(self.manifest, current, self.path, paired)
        if expected_keys is not None:
            self._refuse_other_keys(expected_keys)
        self.collation = Collation(
            path=self.path,
            rows=tuple((spec.name, spec.batch_dim, spec.dtype) for spec in header.sample_specs),
            constants=self._load_constants(self.manifest.constants),
            order=tuple(self.boundary),
            plan_constants={  # a plan's own constants (see caching.write.plan_constants)
                key: self._load_constants(plan.constants)
                for key, plan in (self.manifest.plans or {}).items()
                if plan.constants is not None
            },
            padded=padded_dims(header.sample_specs),
        )
        if dataset is not None:
            verify_inputs(self, dataset)

    @property
    def constants(self) -> Mapping[str, torch.Tensor]:
        """The per-dataset constants, in the dtypes stage 2 takes (in a cache of several plans:
        loader batch 0's plan's; ``collation.constants_of(key)`` gives a plan's own)."""
        return self.collation.constants

    @property
    def paired_rows(self) -> Any:
        """Where stage 2 pairs its batch's rows (a ``PairedRows``), or None: rows regroup freely."""
        return self.manifest.header.paired_rows

    @cached_property
    def stage1_batches(self) -> tuple[tuple[int, ...], ...] | None:
        """Each stage-1 batch's sample indices, in a cache of paired rows (else None)."""
        return stage1_batches(self.manifest)

    @property
    def max_abs_error(self) -> Mapping[str, float]:
        """The largest error lower-precision storage introduced, per tensor (empty: lossless)."""
        return self.manifest.max_abs_error

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> CachedSample:
        shard, row = self._locate(index)
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._open(shard)
        item = CachedSample(key=self.keys[self._starts[shard] + row])
        item.collation = self.collation
        item.signature = self.signatures[index]
        orders = self.manifest.shards[shard].row_orders[row]
        try:
            for name, stored_name in self._tensor_names[row]:
                # A copy: the view of the shard's map would carry an in-place change
                # (item["latents"].mul_(0)) into every later read of this sample.
                item[name] = handle.get_tensor(stored_name).clone()
        except Exception as error:  # safetensors raises its own error types
            raise self._corrupt_error(shard, f"reading row {row} failed ({error})") from None
        if any(orders):
            item.dim_orders = orders
            for (name, batch_dim, _), order in zip(self.collation.rows, orders):
                if order is not None:
                    item[name] = item[name].permute(inverse(row_order(order, batch_dim)))
        return item

    def shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """The shape of each of sample ``index``'s rows, without reading the shard."""
        shard, row = self._locate(index)
        return dict(zip(self._sample_names, self.manifest.shards[shard].shapes[row]))

    @cached_property
    def sample_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """``shapes(i)`` for every sample, for bucketing samplers."""
        return [
            dict(zip(self._sample_names, shapes))
            for shard in self.manifest.shards
            for shapes in shard.shapes
        ]

    def buckets(self) -> dict[tuple[tuple[int | None, ...], ...], list[int]]:
        """Sample indices grouped by their rows' shapes: each group collates into batches
        (:meth:`loader` and :class:`~graphsplit.BucketBatchSampler` batch by them). A padded
        row's padded size is None in the key (captions as code points, whose width is the
        longest caption of their stage-1 batch): any widths batch, padded with zeros."""
        pads = [self.collation.padded.get(name) for name, _, _ in self.collation.rows]
        groups: dict[Any, list[int]] = {}
        index = 0
        for shard in self.manifest.shards:
            for shapes in shard.shapes:
                # A cache of several plans: one plan a batch too (stage 2 runs one plan).
                signature, key = self.signatures[index], bucket_key(shapes, pads)
                groups.setdefault(key if signature is None else (signature, key), [])
                groups[key if signature is None else (signature, key)].append(index)
                index += 1
        return groups

    def loader(
        self,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        **loader_options: Any,
    ) -> BucketLoader:
        """A stage-2 ``DataLoader`` over this cache whose every batch has one shape.

        Its batch sampler is a :class:`~graphsplit.BucketBatchSampler` (seeded, resumable,
        sharded across ``torch.distributed`` processes; see it for the rules), its collate
        function :func:`~graphsplit.collate`; ``loader_options`` go to ``DataLoader``
        (``num_workers``, ``pin_memory``...). The loader's ``set_epoch``, ``state_dict`` and
        ``load_state_dict`` are its sampler's, counting the batches the loader delivered. A
        cache whose stage 2 pairs rows by position (:attr:`paired_rows`) is read in its stage-1
        batches, whole (:class:`~graphsplit.caching.read.whole_batches.WholeBatchSampler`):
        ``batch_size`` must be their row count, anything else raises :class:`CacheError`.

        Example:
            >>> loader = cached.loader(batch_size=3, seed=0)  # doctest: +SKIP
            >>> [tuple(batch["latents"].shape) for batch in loader]  # doctest: +SKIP
        """
        options = {"shuffle": shuffle, "seed": seed, "drop_last": drop_last}
        options.update(num_replicas=num_replicas, rank=rank)
        sampler = paired_sampler(self, batch_size, **options)
        sampler = sampler or BucketBatchSampler(self, batch_size, **options)
        loader_options.setdefault("collate_fn", collate)
        return BucketLoader(self, batch_sampler=sampler, **loader_options)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = {}  # open files do not cross processes (forked ones may)
        return state

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            index += len(self.keys)
        if not 0 <= index < len(self.keys):
            raise IndexError(f"sample {index} is out of range for a cache of {len(self.keys)}")
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def _open(self, shard: int) -> Any:
        if shard in self._corrupt:
            raise self._corrupt_error(shard, self._corrupt[shard])
        record = self.manifest.shards[shard]
        checksum = self.verify and shard not in self._checksummed
        handle, problem = self._open_file(record, checksum=checksum, manifest=self.manifest)
        if problem is not None:
            self._corrupt[shard] = problem
            raise self._corrupt_error(shard, problem)
        self._checksummed.add(shard)
        if len(self._handles) >= _MAX_OPEN_SHARDS:
            del self._handles[next(iter(self._handles))]  # the longest open
        self._handles[shard] = handle
        return handle

    def _open_file(
        self, record: FileRecord, *, checksum: bool, manifest: Manifest | None
    ) -> tuple[Any, str | None]:
        """Open a file of the cache once (see :func:`open_problem`): from the cache itself, or
        from its checksummed local copy (downloaded again once if the copy found is damaged)."""
        if self._copies is None:
            return open_problem(self.path / record.file, record, manifest, checksum=checksum)
        assert isinstance(self.path, RemotePath)
        url = self.path / record.file
        copy = self._copies.fetch(url, record)
        if isinstance(copy, str):
            return None, copy
        handle, problem = open_problem(copy, record, manifest, checksum=checksum)
        if problem is not None:  # a damaged local copy: replace it by a fresh download
            copy = self._copies.fetch(url, record, fresh=True)
            if isinstance(copy, str):
                return None, copy
            handle, problem = open_problem(copy, record, manifest, checksum=checksum)
        return handle, problem

    def _corrupt_error(self, shard: int, problem: str) -> CorruptCacheError:
        record = self.manifest.shards[shard]
        return user_error(
            CorruptCacheError,
            f"shard {record.file} of the cache at {self.path} is damaged: "
            f"{problem}{restart_cause(self.manifest)}. It holds {len(record.keys)} samples: "
            f"{some_keys(record.keys)}; the other shards still read.",
            fix=Fix(
                "run graphsplit.check_cache(path) to list every damaged shard, then rebuild the "
                "cache (run cache again with {remedy})",
                Remedy.OVERWRITE,
            ),
        )

    def _load_constants(self, record: ConstantsRecord | None) -> dict[str, torch.Tensor]:
        header = self.manifest.header
        if record is None:
            return {}
        handle, problem = self._open_file(record, checksum=self.verify, manifest=None)
        constants: dict[str, torch.Tensor] = {}
        if problem is None:
            try:
                for spec in header.constant_specs:
                    value = handle.get_tensor(spec.name)
                    order = record.dim_orders.get(spec.name)
                    if order is not None:
                        value = value.permute(inverse(order))
                    constants[spec.name] = value.to(spec.dtype)
            except StorageError:
                raise
            except Exception as error:
                problem = f"it cannot be read ({error})"
        if problem is not None:
            raise user_error(
                CorruptCacheError,
                f"{record.file} of the cache at {self.path} is damaged: "
                f"{problem}{restart_cause(self.manifest)}; every batch needs it.",
                fix=Fix(REBUILD, Remedy.OVERWRITE),
            )
        return constants

    def _refuse_other_keys(self, expected_keys: Iterable[Any]) -> None:
        expected = [str(key) for key in expected_keys]
        cached = set(self.keys)
        missing = [key for key in expected if key not in cached]
        wanted = set(expected)
        extra = [key for key in self.keys if key not in wanted]
        if missing or extra:
            raise user_error(
                StaleCacheError,
                f"the cache at {self.path} holds other samples than expected: "
                + describe_changes(missing=missing, removed=extra)
                + ".",
                fix=Fix(REBUILD, Remedy.OVERWRITE),
            )


def verify_inputs(cached: CachedDataset | str | os.PathLike[str], dataset: Any) -> None:
    """Refuse a cache whose samples' stage-1 inputs differ from ``dataset``'s items.

    Every item's inputs (the fields ``split.input_names``, as ``default_collate`` would batch
    them) are hashed and compared with the digest recorded when the cache was written; items
    are matched by their ``"key"`` field, or by index when they have none. This reads the whole
    dataset once.

    Raises:
        StaleCacheError: naming the changed, added and removed sample keys.

    Example:
        >>> verify_inputs(path, CaptionedImages(16))  # doctest: +SKIP
    """
    if not isinstance(cached, CachedDataset):
        cached = CachedDataset(cached, verify=False)
    names = cached.manifest.header.inputs
    recorded = {
        key: digest
        for shard in cached.manifest.shards
        for key, digest in zip(shard.keys, shard.input_sha256)
    }
    changed: list[str] = []
    added: list[str] = []
    seen: set[str] = set()
    for index in range(len(dataset)):
        item = dataset[index]
        if not isinstance(item, Mapping):
            item = dict(zip(names, item))
        if any(name not in item for name in names):
            raise _item_lacks_inputs(index, item, names, cached.path)
        key = str(item["key"]) if "key" in item else str(index)
        seen.add(key)
        if key not in recorded:
            added.append(key)
        elif item_input_digest(item, names) != recorded[key]:
            changed.append(key)
    removed = [key for key in recorded if key not in seen]
    if changed or added or removed:
        hint = ""
        if changed and len(changed) == len(recorded):
            hint = (
                " (every sample differs: if the loader's collate_fn transforms items, e.g. "
                "pads them, inputs cannot be compared item by item)"
            )
        raise user_error(
            StaleCacheError,
            f"the cache at {cached.path} was made from other data: "
            + describe_changes(changed=changed, added=added, removed=removed)
            + f"{hint}.",
            fix=Fix(REBUILD, Remedy.OVERWRITE),
        )


def _item_lacks_inputs(
    index: int, item: Mapping[str, Any], names: Sequence[str], path: Path | RemotePath
) -> GraphsplitError:
    """The error for dataset item ``index``, which lacks some of stage 1's inputs ``names``."""
    missing = [name for name in names if name not in item]
    return user_error(
        CacheError,
        f"item {index} of the dataset lacks {missing}; stage 1 of the cache at {path} takes "
        f"{list(names)}",
        fix=Fix("pass the dataset the cache was made from (its items hold those inputs)"),
    )
