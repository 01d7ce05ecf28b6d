"""Stage-1 batches read back whole: the batch sampler for a cache whose stage 2 pairs rows.

A step that combines rows of its batch by position (TRL's DPO stacks ``[chosen; rejected]``
and takes ``logps.chunk(2)``, then ``chosen - rejected``) is only right on the batches stage 1
ran: regrouping the cached rows into other batches, as
:class:`~graphsplit.BucketBatchSampler` does, would pair the wrong rows without an error. Such
a split carries ``split.paired_rows`` (a :class:`~graphsplit.artifacts.PairedRows`); its cache
records it, and each shard records how many rows each stage-1 batch put in it
(``ShardRecord.batch_rows``, see :mod:`graphsplit.caching.format.layout`), so the reader
recovers every stage-1 batch's sample indices exactly.

Glossary:
    stage-1 batch: the rows one stage-1 call cached, consecutive in the cache, in its row
        order (a shard holds whole batches; a short last batch stays short).
    global batch list: every stage-1 batch of one epoch, for all processes, in training
        order: the batches shuffled as units (``shuffle``, ``seed`` and the epoch), never their
        rows; with ``drop_last`` the batches shorter than the longest are left out. Evened out
        and shared across processes by whole batches exactly as
        :class:`~graphsplit.BucketBatchSampler` does (see its glossary).

In and out::

    stage1_batches(manifest) -> ((sample index, ...), ...)      # None for an ordinary cache
    paired_sampler(cached, batch_size, **options) -> WholeBatchSampler | None
        # CachedDataset.loader's sampler for a paired cache (None: an ordinary one); a
        # batch_size other than the stage-1 batches' row count raises CacheError
    WholeBatchSampler(source, *, shuffle=True, seed=0, drop_last=False, num_replicas=None,
                      rank=None)      # a BucketBatchSampler whose batches are stage 1's, whole
        iter(sampler) -> lists of sample indices      len(sampler) -> batches per epoch, here
        .set_epoch(epoch)   .state_dict() -> dict   .load_state_dict(state)
        .epoch_batches(epoch)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphsplit.caching.format.layout import Manifest
from graphsplit.caching.read.bucket_sampler import (
    BucketBatchSampler,
    _epoch_seed,
    regrouping_error,
    replicas,
)

__all__ = ["WholeBatchSampler", "paired_sampler", "stage1_batches"]


def stage1_batches(manifest: Manifest) -> tuple[tuple[int, ...], ...] | None:
    """Each stage-1 batch's sample indices, in cache order; None when the cache records none
    (an ordinary cache: its rows may be regrouped freely).

    Example:
        >>> from types import SimpleNamespace as Record
        >>> shards = (Record(batch_rows=(4, 4)), Record(batch_rows=(2,)))
        >>> stage1_batches(Record(shards=shards))
        ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))
    """
    if any(shard.batch_rows is None for shard in manifest.shards) or not manifest.shards:
        return None
    batches, start = [], 0
    for shard in manifest.shards:
        for count in shard.batch_rows:
            batches.append(tuple(range(start, start + count)))
            start += count
    return tuple(batches)


def paired_sampler(cached: Any, batch_size: int, **options: Any) -> WholeBatchSampler | None:
    """The batch sampler :meth:`CachedDataset.loader` uses on a cache whose stage 2 pairs rows
    (None for an ordinary cache). ``batch_size`` must be the stage-1 batches' row count (the
    longest's: a short last batch is read as it is): stage 2 then gets exactly the batches
    stage 1 cached. Any other size would regroup rows, and is refused.

    Raises:
        CacheError: ``batch_size`` is not the stage-1 batches' row count; the message names
            the user's line where rows meet, and the size to pass.
    """
    paired, batches = cached.paired_rows, cached.stage1_batches
    if paired is None or batches is None:
        return None
    rows = max(map(len, batches))
    if batch_size != rows:
        raise regrouping_error(
            paired,
            f"loader(batch_size={batch_size}) over stage-1 batches of {rows} rows",
            (
                f"pass loader(batch_size={rows}): it reads the cached stage-1 batches whole, "
                "in a shuffled order (to train on other batch sizes, cache with a loader of "
                "that batch size)"
            ),
        )
    return WholeBatchSampler(cached, **options)


class WholeBatchSampler(BucketBatchSampler):
    """Each stage-1 batch whole, in its cached row order: seeded, resumable, sharded.

    The batches' order is a pure function of ``seed`` and the epoch (``shuffle=False``: cache
    order); a batch's rows are never reordered or split, so stage 2 pairs the rows stage 1 ran
    together. ``batch_size`` is the longest stage-1 batch's row count. Epochs, resuming
    (``state_dict``, ``load_state_dict``, ``set_epoch``), ``len`` and the sharding across
    ``num_replicas`` processes by whole batches (padding or, with ``drop_last``, truncating
    the global list to a multiple of ``num_replicas``) are :class:`BucketBatchSampler`'s.

    Args:
        source: a :class:`~graphsplit.CachedDataset` of a paired cache, or the stage-1 batches
            themselves (sequences of sample indices).
        shuffle: shuffle the batches (as units) each epoch.
        seed: the shuffle's seed, the same on every process.
        drop_last: leave out the batches shorter than the longest (a short last batch), and
            truncate (rather than pad) the global batch list to a multiple of ``num_replicas``.
        num_replicas, rank: the processes sharing an epoch, and this one's place among them.

    Example:
        >>> sampler = WholeBatchSampler([(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)], seed=0)
        >>> sorted(tuple(batch) for batch in sampler)  # each batch whole, rows in order
        [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
        >>> len(WholeBatchSampler([(0, 1), (2, 3), (4,)], drop_last=True)), sampler.batch_size
        (2, 4)
    """

    def __init__(
        self,
        source: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        batches = _batches_of(source)
        num_replicas, rank = replicas(num_replicas, rank)
        # ``buckets`` holds the batches: BucketBatchSampler's state counts samples over them.
        self.buckets = batches
        self.batch_size = max(map(len, batches), default=1)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.position = 0
        count = len(self._kept())
        per_process = count // num_replicas if drop_last else -(-count // num_replicas)
        self._per_process = per_process

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This process's batches of ``epoch``, in order (computed from indices only)."""
        batches = [list(batch) for batch in self._kept()]
        if self.shuffle:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        evened = self._per_process * self.num_replicas
        if batches:  # padded with its own first batches, or truncated
            batches = [batches[i % len(batches)] for i in range(evened)]
        return batches[self.rank :: self.num_replicas]

    def _kept(self) -> tuple[tuple[int, ...], ...]:
        """The stage-1 batches an epoch trains: all, or with ``drop_last`` the full ones."""
        if not self.drop_last:
            return self.buckets
        return tuple(batch for batch in self.buckets if len(batch) == self.batch_size)


def _batches_of(source: Any) -> tuple[tuple[int, ...], ...]:
    """The stage-1 batches of a paired cache, or ``source`` itself as batches of indices."""
    manifest = getattr(source, "manifest", None)
    if manifest is None:
        batches: Sequence[Sequence[int]] = source
        return tuple(tuple(int(index) for index in batch) for batch in batches)
    found = stage1_batches(manifest)
    if found is None:
        raise ValueError(
            f"the cache at {source.path} records no stage-1 batches (its split does not pair "
            "rows by position): read it with cached.loader(batch_size) or a BucketBatchSampler"
        )
    return found
