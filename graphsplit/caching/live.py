"""Cache while training: the first epoch runs the split step on raw batches and writes the cache.

``cache()`` is a pass of its own before training, although the first epoch computes the same
frozen outputs anyway. A :class:`LiveCache` folds it into that epoch: ``step(batch)`` runs
stage 1 on the raw batch, hands its outputs to the writer
(:mod:`graphsplit.caching.write.live_writer`: same files, fingerprint and manifest as
``cache()``) and returns stage 2's output, which is the unsplit step's, bit for bit (stage 1
draws nothing; stage 2 draws what the step draws, in its order). ``finish()`` writes the
manifest; from then on ``step(batch)`` answers from the cache by sample key (no stage 1),
and ``dataset()`` is the :class:`~graphsplit.CachedDataset` to train later epochs from
without loading raw data at all.

Glossary:
    epoch 1: the batches ``step`` sees before ``finish``; any order, any sampler, any process.
    resume: an interruption (an exception leaving the ``with`` block, ``kill -9``) keeps the
        shards already committed; the next ``LiveCache`` on the folder starts the epoch again,
        writing only the samples those shards lack (stage 1 still runs for the others, as the
        step needs their boundary).

In and out::

    with LiveCache(split, path, *, accelerator=None, shard_bytes=..., storage_dtype=None,
                   overwrite=False, durable=True) as live:
        loss = live.step(batch)          # batch: {input names..., "key": [one per sample]}
        info = live.finish()             # -> CacheInfo; leaving the block cleanly finishes too
    live.dataset(**options) -> CachedDataset
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from graphsplit.caching.loader.batches import as_mapping, batch_keys
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store.remote import RemotePath, location
from graphsplit.caching.write.cache_run import (
    DEFAULT_SHARD_BYTES,
    CacheInfo,
    _info,
    _storage_name,
)
from graphsplit.caching.write.live_writer import LiveWriter
from graphsplit.caching.write.plan_rows import run_stage1
from graphsplit.caching.write.processes import Processes
from graphsplit.errors import CacheError, Fix, Remedy, StaleCacheError, user_error
from graphsplit.signatures.signature import SIGNATURE_KEY
from graphsplit.units import some_keys

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["LiveCache"]


class LiveCache:
    """Write a split's cache during the first epoch of training, then train from it.

    ``step(batch)`` returns what the unsplit step returns for ``batch`` (the loss), with the
    same random draws and the same gradients, and stores the batch's stage-1 outputs under
    its sample keys. The loader may shuffle; each batch must carry ``"key"``, one unique name
    per sample (a shuffled epoch has no positions to name samples by). A key seen again (a
    second epoch before ``finish``, a sampler that repeats) is not written twice; its inputs
    must be the same as the first time. After ``finish()`` (or leaving the ``with`` block
    without an exception) the folder is a complete cache, read unchanged by
    :class:`~graphsplit.CachedDataset`, :func:`~graphsplit.check_cache` and ``cache()``;
    ``step`` then reads each batch's boundary from it by key. An exception in the block, or
    ``kill -9``, leaves the committed shards; a new ``LiveCache`` on the folder resumes from
    them. A folder that already holds this split's complete cache is read from the start.

    Under ``accelerate launch`` every process makes its own ``LiveCache`` with the
    ``accelerator``, steps through its own batches (a prepared loader) and writes shards of
    its own; ``finish`` (every process) numbers them and the main process writes the
    manifest. The folder must be shared by the processes, as for ``cache()``. ``finish`` waits
    for every process: one that stopped with an error leaves the others waiting there, as a
    DDP step would (stop them all; the committed shards are kept for the rerun).

    Args:
        split: what :func:`graphsplit.split` returned.
        path: the cache folder (local or shared; created if missing).
        accelerator: an ``accelerate.Accelerator`` for a multi-process run.
        shard_bytes: the target shard size.
        storage_dtype: ``None`` (lossless: later epochs are exact), ``torch.bfloat16`` or
            ``torch.float16`` (as in ``cache()``; later epochs then see the rounded boundary).
        overwrite: replace a cache of another split or other options instead of refusing.
        durable: fsync every file (see ``cache()``).

    Raises:
        StaleCacheError: the folder holds a cache made differently (other weights, code,
            storage or shard size) and ``overwrite`` is false, or a key came back with other
            inputs; CacheError: a batch without keys, a remote path; CacheLockedError: another
            run writes the folder.

    Example:
        >>> import tempfile, torch, graphsplit
        >>> class Step(torch.nn.Module):  # a frozen encoder and a trainable head
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.encoder = torch.nn.Linear(4, 4).requires_grad_(False)
        ...         self.head = torch.nn.Linear(4, 1)
        ...     def forward(self, x):
        ...         return self.head(self.encoder(x)).pow(2).mean()
        >>> step = Step()
        >>> split = graphsplit.split(step, args=(torch.randn(2, 4),))
        >>> data = [{"x": torch.randn(4), "key": f"sample-{i}"} for i in range(6)]
        >>> loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
        >>> with graphsplit.LiveCache(split, tempfile.mkdtemp(), durable=False) as live:
        ...     for batch in loader:
        ...         assert torch.equal(live.step(batch), step(batch["x"]))
        >>> len(live.dataset())
        6
    """

    def __init__(
        self,
        split: Split,
        path: str | os.PathLike[str],
        *,
        accelerator: Any = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        storage_dtype: torch.dtype | None = None,
        overwrite: bool = False,
        durable: bool = True,
    ) -> None:
        folder = location(path)
        if isinstance(folder, RemotePath):
            raise user_error(
                CacheError,
                f"a live cache is written to a local or shared folder, not to {folder}.",
                fix=Fix(
                    "cache while training into a local folder, then upload it; or write a "
                    "bucket with graphsplit.cache"
                ),
            )
        if type(shard_bytes) is not int or shard_bytes < 1:
            raise ValueError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
        self.split = split
        self.path = folder
        self._storage_dtype = storage_dtype
        self._device = _stage_device(split.stage1, accelerator)
        self._writer: LiveWriter | None = LiveWriter.open(
            split,
            folder,
            processes=Processes(accelerator),
            shard_bytes=shard_bytes,
            storage_dtype=_storage_name(storage_dtype),
            overwrite=overwrite,
            durable=durable,
        )
        self._info: CacheInfo | None = None
        self._cached: CachedDataset | None = None
        self._rows: dict[str, int] = {}
        if self._writer.complete is not None:
            manifest = self._writer.finish()
            self._writer = None
            self._info = _info(folder, manifest, written=0)

    @property
    def complete(self) -> bool:
        """Whether the folder holds the complete cache (``step`` then reads from it)."""
        return self._info is not None

    @property
    def written_samples(self) -> int:
        """How many samples this process wrote so far (known keys are not written again)."""
        return 0 if self._writer is None else self._writer.written_rows

    def step(self, batch: Mapping[str, Any]) -> Any:
        """Stage 2's output for ``batch`` (the unsplit step's), storing its boundary."""
        keys = _keys(batch)
        if self._info is not None:
            return self._from_cache(keys)
        if self._writer is None:
            raise user_error(
                CacheError,
                f"this LiveCache of {self.path} was closed before the cache was finished.",
                fix=Fix("make a new LiveCache on the folder: it resumes from the committed shards"),
            )
        header = self._writer.header
        outputs, plan = run_stage1(
            self.split, batch, len(keys), self._device, header, mode=torch.no_grad
        )
        inputs = as_mapping(batch, header.inputs)
        self._writer.add(keys, inputs, outputs, plan)
        if plan is not None:
            outputs = {**outputs, SIGNATURE_KEY: plan.key}
        return self.split.stage2(**outputs)

    def commit(self) -> None:
        """Commit the rows held in memory now (e.g. as a checkpoint is saved): a ``LiveCache``
        made later on the folder, after an interruption, resumes with them."""
        if self._writer is not None:
            self._writer.commit()

    def finish(self) -> CacheInfo:
        """Write the manifest (every process calls it): the folder is a complete cache."""
        if self._info is None:
            assert self._writer is not None
            manifest = self._writer.finish()
            self._info = _info(self.path, manifest, written=len(manifest.shards))
            self._writer = None
        return self._info

    def close(self) -> None:
        """Stop without finishing: the committed shards stay for a later run to resume."""
        if self._writer is not None:
            self._writer.abandon()
            self._writer = None

    def dataset(self, **options: Any) -> CachedDataset:
        """The finished cache as a :class:`~graphsplit.CachedDataset` (``options`` go to it)."""
        if self._info is None:
            raise user_error(
                CacheError,
                f"the live cache at {self.path} is not finished yet.",
                fix=Fix("call live.finish() at the end of the first epoch first"),
            )
        return CachedDataset(self.path, self.split, **options)

    def __enter__(self) -> LiveCache:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.finish()
        else:
            self.close()

    def _from_cache(self, keys: list[str]) -> Any:
        """Stage 2 on the batch's rows read from the complete cache."""
        if self._cached is None:
            self._cached = self.dataset()
            self._rows = {key: index for index, key in enumerate(self._cached.keys)}
        missing = [key for key in keys if key not in self._rows]
        if missing:
            raise user_error(
                StaleCacheError,
                f"the cache at {self.path} holds no sample {some_keys(missing)}: the first epoch "
                "did not see it.",
                fix=Fix(
                    "run the first epoch over every sample before finishing, or pass {remedy} "
                    "to write the cache afresh",
                    Remedy.OVERWRITE,
                ),
            )
        boundary = collate([self._cached[self._rows[key]] for key in keys])
        device = _stage_device(self.split.stage2, None) or self._device  # where stage 2 trains
        if device is not None:
            boundary = {
                name: value.to(device) if isinstance(value, torch.Tensor) else value
                for name, value in boundary.items()
            }
        return self.split.stage2(**boundary)


def _keys(batch: Mapping[str, Any]) -> list[str]:
    if not isinstance(batch, Mapping) or batch.get("key") is None:
        raise user_error(
            CacheError,
            "a live cache needs each batch's sample keys (batch['key'], one per sample); this "
            f"batch is a {type(batch).__name__} without them.",
            fix=Fix(
                "give each dataset item a unique str 'key' (default_collate batches them into "
                "a list): a shuffled epoch has no positions to name samples by"
            ),
        )
    raw = batch["key"]
    size = len(raw.tolist() if isinstance(raw, torch.Tensor) else raw)
    return batch_keys(batch, range(size))


def _stage_device(stage1: torch.nn.Module, accelerator: Any) -> torch.device | None:
    for tensor in itertools.chain(stage1.parameters(), stage1.buffers()):
        return tensor.device
    return None if accelerator is None else accelerator.device
