"""Batches of one shape for stage 2: a seeded, resumable batch sampler over a cache's buckets,
sharded across processes.

A cache of several shapes (aspect-ratio buckets, frame counts) cannot be batched by a plain
shuffled ``DataLoader``: :func:`~graphsplit.caching.read.collation.collate` refuses a batch
whose samples differ in shape. :class:`BucketBatchSampler` makes every batch of one bucket.

Glossary:
    bucket: the samples whose rows have one tuple of shapes
        (:meth:`~graphsplit.caching.read.dataset.CachedDataset.buckets`); only they batch
        together.
    global batch list: every batch of one epoch, for all processes, in training order: each
        bucket's samples shuffled and cut into batches of ``batch_size`` (a bucket's last,
        shorter batch kept or, with ``drop_last``, dropped), then all batches shuffled
        together. It depends only on the buckets, the options, ``seed`` and the epoch, so every
        process computes the same list without talking to the others.
    evening out: making the global list a multiple of ``num_replicas`` long, so that every
        process trains the same number of batches (none waits on a collective the others
        skip). ``drop_last=False`` pads it with its own first batches (every sample is trained
        each epoch; at most ``num_replicas - 1`` batches twice), ``drop_last=True`` truncates
        it (no sample twice; at most ``num_replicas - 1`` batches, other ones each epoch, left
        out): the two choices ``DistributedSampler`` makes for samples, here for whole batches.
    share: the batches one process trains: ``evened[rank::num_replicas]``, so the processes'
        ``i``-th batches are consecutive batches of the global list.
    position: how many of this process's batches of ``epoch`` were handed out; the state
        ``(epoch, position)`` names the next batch, and is the same on every process.

In and out::

    BucketBatchSampler(source, batch_size, *, shuffle=True, seed=0, drop_last=False,
                       num_replicas=None, rank=None)
        iter(sampler) -> lists of sample indices      len(sampler) -> batches per epoch, here
        .set_epoch(epoch)   .state_dict() -> dict   .load_state_dict(state)
        .epoch_batches(epoch) -> this process's batches of that epoch (no data read)
    BucketLoader(dataset, batch_sampler=sampler, ...)  # a DataLoader that counts the batches
        it delivered into the sampler's position (exact with workers prefetching)
    regrouping_error(paired, what, fix_words) -> CacheError  # a cache whose stage 2 pairs rows

A cache whose stage 2 pairs its batch's rows by position (``cached.paired_rows``) is refused:
regrouped rows would pair wrongly (:mod:`graphsplit.caching.read.whole_batches` reads it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from graphsplit.errors import CacheError, Fix, GraphsplitError, user_error

__all__ = ["BucketBatchSampler", "BucketLoader", "regrouping_error", "replicas"]

# What a state_dict holds besides the position, and must match on load: another value means
# another global batch list, where the saved position would name other batches.
_SAME_ON_RESUME = ("seed", "batch_size", "shuffle", "drop_last", "num_replicas", "samples")


class HasBuckets(Protocol):
    """A dataset that groups its sample indices by shape (``CachedDataset``)."""

    def buckets(self) -> Mapping[Hashable, Sequence[int]]: ...


class BucketBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of one shape each from a cache of several: seeded, resumable, sharded.

    Every batch holds samples of one bucket (:meth:`CachedDataset.buckets`), so
    :func:`graphsplit.collate` never meets two shapes. The order is a pure function of
    ``seed`` and the epoch: each bucket is shuffled and cut into batches, then the batches of
    all buckets are shuffled together (``shuffle=False``: buckets in order of their shapes,
    samples in cache order). Iterating it again after a full epoch gives the next epoch;
    :meth:`set_epoch` picks one, as with ``DistributedSampler``.

    Across processes (``num_replicas`` and ``rank``, by default from ``torch.distributed``
    when it is initialised, as ``DistributedSampler`` does), every process computes the same
    global batch list and trains every ``num_replicas``-th batch of it, from its ``rank``-th:
    the processes' batches are disjoint and together cover the epoch, and every process gets
    ``len(sampler)`` batches. When the batch count is not a multiple of ``num_replicas``,
    ``drop_last=False`` pads the list with its first batches (every sample trained each
    epoch, at most ``num_replicas - 1`` batches twice) and ``drop_last=True`` truncates it (a
    bucket's last, shorter batch is dropped too; nothing is trained twice). Every process must
    be given the same ``seed``.

    Resuming: :meth:`state_dict` holds the epoch and the number of this process's batches of
    it already handed out (the same on every process); :meth:`load_state_dict` restores it,
    and the next iteration skips those batches without reading their data. Calling
    :meth:`set_epoch` with the restored epoch keeps the position; another epoch starts at its
    beginning. A plain ``DataLoader`` with workers asks for batches ahead of the training
    loop, so the sampler's count runs ahead; :meth:`CachedDataset.loader` returns a
    :class:`BucketLoader`, which counts the batches it delivered.

    Under ``accelerate launch`` give the loader to the training loop as it is, not to
    ``accelerator.prepare``: prepare wraps every batch sampler in its own ``BatchSamplerShard``,
    which would keep only every ``num_replicas``-th batch of this process's share. Move the
    batches to ``accelerator.device`` yourself; ``accelerator.register_for_checkpointing``
    with the loader (or sampler) saves and restores its position with ``save_state``.

    Args:
        source: a dataset with ``buckets()`` (a :class:`CachedDataset`), or the buckets
            themselves: ``{shape: [sample index, ...]}``.
        batch_size: samples per batch (a bucket's last batch may be shorter).
        shuffle: shuffle samples within buckets and batches across them.
        seed: the shuffle's seed, the same on every process.
        drop_last: drop each bucket's last, shorter batch, and truncate (rather than pad) the
            global batch list to a multiple of ``num_replicas``.
        num_replicas: the number of processes sharing an epoch.
        rank: this process's place among them.

    Example:
        >>> buckets = {(8, 8): [0, 2, 4, 6, 8], (8, 12): [1, 3, 5, 7]}
        >>> sampler = BucketBatchSampler(buckets, batch_size=2, seed=0)
        >>> batches = list(sampler)
        >>> sorted(index for batch in batches for index in batch)  # each sample once
        [0, 1, 2, 3, 4, 5, 6, 7, 8]
        >>> all({index % 2 for index in batch} in ({0}, {1}) for batch in batches)  # one shape
        True
        >>> batches == list(BucketBatchSampler(buckets, batch_size=2, seed=0))  # reproducible
        True
        >>> len(sampler), sampler.state_dict()["epoch"]  # the next iteration is epoch 1
        (5, 1)
        >>> [len(BucketBatchSampler(buckets, 2, num_replicas=2, rank=r)) for r in (0, 1)]
        [3, 3]
        >>> [len(BucketBatchSampler(buckets, 2, drop_last=True, num_replicas=2, rank=r))
        ...  for r in (0, 1)]
        [2, 2]
    """

    def __init__(
        self,
        source: HasBuckets | Mapping[Hashable, Sequence[int]],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size should be a positive integer, got {batch_size!r}")
        num_replicas, rank = replicas(num_replicas, rank)
        paired = None if isinstance(source, Mapping) else getattr(source, "paired_rows", None)
        if paired is not None:
            rows = max(map(len, source.stage1_batches))
            raise regrouping_error(
                paired,
                "a BucketBatchSampler",
                (
                    f"batch the cache with cached.loader(batch_size={rows}), which reads the "
                    "cached stage-1 batches whole in a shuffled order (or pass "
                    "graphsplit.caching.read.whole_batches.WholeBatchSampler(cached) to your "
                    "DataLoader as its batch_sampler)"
                ),
            )
        groups = source if isinstance(source, Mapping) else source.buckets()
        # Buckets in order of their shapes: the list must not depend on which shard came first.
        self.buckets: tuple[tuple[int, ...], ...] = tuple(
            tuple(groups[shape]) for shape in sorted(groups, key=repr)
        )
        self.batch_size = batch_size  # the attribute names torch's BatchSampler uses
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.position = 0
        cut = (lambda n: n // batch_size) if drop_last else (lambda n: -(-n // batch_size))
        global_count = sum(cut(len(bucket)) for bucket in self.buckets)
        if drop_last:
            self._per_process = global_count // num_replicas
        else:
            self._per_process = -(-global_count // num_replicas)

    def __len__(self) -> int:
        """Batches this process trains per epoch (a resumed epoch yields the rest of them)."""
        return self._per_process

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.position
        share = self.epoch_batches(epoch)
        for handed_out, batch in enumerate(share[start:], start=start + 1):
            self._mark(epoch, handed_out)  # before the yield: the state names the next batch
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """Train epoch ``epoch`` next: from its start, or, if it is the epoch the state names
        (a restored one), from the state's position."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This process's batches of ``epoch``, in order (computed from indices only)."""
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        batches: list[list[int]] = []
        for bucket in self.buckets:
            order = (
                torch.randperm(len(bucket), generator=generator).tolist()
                if self.shuffle
                else range(len(bucket))
            )
            samples = [bucket[i] for i in order]
            for begin in range(0, len(samples), self.batch_size):
                batch = samples[begin : begin + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        evened = self._per_process * self.num_replicas
        if batches:  # padded with its own first batches, or truncated
            batches = [batches[i % len(batches)] for i in range(evened)]
        return batches[self.rank :: self.num_replicas]

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position"}`` of the next batch, and the options the order depends on
        (checked on load). The same on every process, so saving one process's is enough."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_replicas": self.num_replicas,
            "samples": sum(len(bucket) for bucket in self.buckets),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s epoch and position; refuse a state made for another order."""
        mine = self.state_dict()
        differences = [
            f"{name} {state[name]!r} (now {mine[name]!r})"
            for name in _SAME_ON_RESUME
            if name in state and state[name] != mine[name]
        ]
        if differences:
            raise user_error(
                CacheError,
                f"this {type(self).__name__} state was saved for another order of batches: "
                + ", ".join(differences)
                + "; its position would name other batches.",
                fix=Fix(
                    "resume with the sampler's options, process count and cache of the run that "
                    "saved it, or start the epoch afresh (set_epoch) instead of loading it"
                ),
            )
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"position {state['position']} is not in [0, {len(self)}]")
        self._mark(int(state["epoch"]), int(state["position"]))

    def _mark(self, epoch: int, handed_out: int) -> None:
        """Record that ``handed_out`` batches of ``epoch`` are done; all of them: the next
        epoch is due."""
        if handed_out >= len(self) > 0:
            epoch, handed_out = epoch + 1, 0
        self.epoch, self.position = epoch, handed_out


class BucketLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` over a :class:`BucketBatchSampler` that counts what it delivers.

    Workers fetch batches ahead of the training loop, so the sampler alone would count
    prefetched batches as done; this loader writes the number it has handed to the loop into
    the sampler's position after each batch, so :meth:`state_dict` taken between steps resumes
    at the next untrained batch. ``set_epoch``, ``state_dict`` and ``load_state_dict`` are the
    sampler's (the conventions of ``DistributedSampler`` and of stateful data loaders).
    """

    batch_sampler: BucketBatchSampler

    def __iter__(self) -> Iterator[Any]:
        sampler = self.batch_sampler
        epoch, start = sampler.epoch, sampler.position
        for delivered, batch in enumerate(super().__iter__(), start=start + 1):
            sampler._mark(epoch, delivered)
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """The sampler's :meth:`BucketBatchSampler.set_epoch`."""
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's :meth:`BucketBatchSampler.state_dict`."""
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The sampler's :meth:`BucketBatchSampler.load_state_dict`."""
        self.batch_sampler.load_state_dict(state)


def regrouping_error(
    paired: Any, what: str, fix: str, error_type: type[GraphsplitError] = CacheError
) -> GraphsplitError:
    """The error for ``what`` regrouping the rows of a cache whose stage 2 pairs them by
    position (``paired``: its ``PairedRows``; see :mod:`graphsplit.caching.read.whole_batches`);
    ``fix`` in words (no option: none of these fixes is one)."""
    return user_error(
        error_type,
        f"{paired.describe()}: {what} regroups the cached rows into batches of its own, so "
        "stage 2 would pair the wrong rows, silently.",
        fix=Fix(fix),
        source=paired.source or None,
    )


def replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``, each from ``torch.distributed`` where not given; refuses a
    rank outside the processes."""
    if num_replicas is None:
        num_replicas = _distributed("get_world_size", 1)
    if rank is None:
        rank = _distributed("get_rank", 0)
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas}) processes")
    return num_replicas, rank


def _distributed(getter: str, default: int) -> int:
    """The world size or rank from ``torch.distributed`` when it is initialised."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(getattr(distributed, getter)())
    return default


def _epoch_seed(seed: int, epoch: int) -> int:
    """One generator seed per ``(seed, epoch)``: ``seed + epoch`` would give seed 0's epoch 1
    the order of seed 1's epoch 0."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
