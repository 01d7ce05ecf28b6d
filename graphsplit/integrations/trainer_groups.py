"""Batches whose samples the trainer's collator pads to one length, for collators that pad
each batch to its longest (``DataCollatorWithPadding``'s default, TRL's collators).

A cached row holds a sample as its batch padded it (its inputs, the teacher's logits over every
position), and a loss over the padded positions depends on that padding. A sample padded to
its batch's longest has as many shapes as the batches the trainer's shuffle puts it in, so no
one row can stand in for it. Exact by construction instead: every batch (the caching pass's,
and every epoch's training batch) holds samples that the collator pads to the same length, so
each sample is padded to its own length (or that rounded up by ``pad_to_multiple_of``) in any
batch, as when it was cached; the unsplit trainer run on the same batches computes the same
losses bit for bit.

Glossary:
    padded shape (:data:`Shape`): the per-sample shapes of the tensors the collator makes from
        the sample alone; ``((name, shape without the batch dim), ...)``.
    group: the dataset indices of one padded shape; a batch holds samples of one group.
    caching batches (:class:`CachingBatches`): each group in dataset order cut into batches of
        the training batch size; a group's last, shorter batch is filled up with the group's
        first samples again (their rows are stored under other keys and never read), so every
        row is computed at the batch size the trainer trains with.
    training batches: :class:`~graphsplit.BucketBatchSampler` over the groups, seeded with the
        trainer's seed, shuffled per epoch, sharded across processes by accelerate as the
        trainer's own sampler is.

In and out::

    groups = padding_groups(dataset, collator, batch_size)   # -> PaddingGroups | None
    CachingBatches(groups, batch_size)      # index lists (fillers: index + repeat * size)
    CheckedCollate(collator, groups)        # items -> the batch, its "key"s, shapes checked
    training_batches(trainer, groups)       # -> BucketBatchSampler over the groups
    refuse_paired_rows(split)               # CacheError: stage 2 pairs rows by position
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphsplit.caching.read.bucket_sampler import BucketBatchSampler, regrouping_error
from graphsplit.errors import CacheError, Fix, user_error

__all__ = [
    "UNGROUPABLE_FIX",
    "CachingBatches",
    "CheckedCollate",
    "GroupEpochs",
    "Indexed",
    "PaddingGroups",
    "Shape",
    "batch_shape",
    "padding_groups",
    "refuse_packing",
    "refuse_paired_rows",
    "regroup",
    "training_batches",
]

Shape = tuple[tuple[str, tuple[int, ...]], ...]

UNGROUPABLE_FIX = Fix(
    "pad every sample to a length of its own (the batch's longest, DataCollatorWithPadding's "
    "default, or that rounded up by pad_to_multiple_of) or to one length for all "
    "(padding='max_length', max_length=N)"
)


@dataclass(frozen=True)
class PaddingGroups:
    """Each dataset index's padded shape, and the indices of each group (keyed by the padded
    shape without the shape-only fields)."""

    shapes: tuple[Shape, ...]
    groups: dict[Shape, list[int]]
    shape_only: dict[str, str] = field(default_factory=dict)
    """Shape-only field -> the boundary key holding its shape (``prompts`` ->
    ``prompts__shape``); empty: every field is grouped on."""

    def padded_shape(self, indices: Sequence[int]) -> Shape:
        """The shape the collator gives these samples (of one group) together: each field's
        shape alone, a shape-only field's the longest of theirs in every dimension."""
        first = self.shapes[indices[0]]
        if not self.shape_only:
            return first
        alone = [dict(self.shapes[index]) for index in indices]
        return tuple(
            (name, tuple(max(sizes) for sizes in zip(*(shapes[name] for shapes in alone))))
            if name in self.shape_only
            else (name, shape)
            for name, shape in first
        )

    def shape_rows(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The shape-only fields' boundary rows for a training batch of these samples: what
        stage 1 stores for the batch the collator makes of them (``[1, *shape[1:]]`` a sample),
        in place of the rows each sample's caching batch stored."""
        padded = dict(self.padded_shape(indices))
        return {
            key: torch.tensor([1, *padded[name]], dtype=torch.int64).repeat(len(indices), 1)
            for name, key in self.shape_only.items()
        }


def batch_shape(batch: Any) -> Shape:
    """The per-sample shapes of a collated batch's tensors (the batch dim left out)."""
    return tuple(
        (str(name), tuple(value.shape[1:]))
        for name, value in batch.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def padding_groups(dataset: Any, collator: Any, batch_size: int) -> PaddingGroups | None:
    """The dataset's samples grouped by the shape the collator gives each alone; ``None`` when
    all have one shape (the cache holds one shape, the trainer's own sampler is kept).

    Collates every sample once (collation only, no model) and then, for each group, its first
    batch together, which must give every sample its group's shape: a collator that pads to
    something other than the samples' own lengths (a random length, the longest seen so far) is
    refused here, before any model runs; each later batch is checked as it is collated.
    """
    refuse_packing(dataset, collator)
    shapes = tuple(batch_shape(collator([dataset[index]])) for index in range(len(dataset)))
    groups: dict[Shape, list[int]] = {}
    for index, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(index)
    if len(groups) <= 1:
        return None
    for shape, indices in groups.items():
        first = indices[:batch_size]
        check_batch(batch_shape(collator([dataset[index] for index in first])), shape, first)
    return PaddingGroups(shapes=shapes, groups=groups)


def regroup(
    groups: PaddingGroups,
    shape_only: dict[str, str],
    dataset: Any,
    collator: Any,
    batch_size: int,
) -> PaddingGroups:
    """``groups`` keyed without the shape-only fields (``shape_only``: field -> the boundary
    key of its shape; :mod:`.trainer_regroup` finds them in the plan): samples of one padded
    length but different prompt lengths share a group. A field some sample lacks, or holds
    with another number of dimensions, stays grouped on. Each group's first batch is checked
    to pad its shape-only fields to the longest of the samples' own, as every caching batch
    is; a collator that does otherwise is refused."""
    shape_only = {name: key for name, key in shape_only.items() if _one_rank(groups.shapes, name)}
    if not shape_only:
        return groups
    keyed: dict[Shape, list[int]] = {}
    for index, shape in enumerate(groups.shapes):
        key = tuple((name, size) for name, size in shape if name not in shape_only)
        keyed.setdefault(key, []).append(index)
    regrouped = PaddingGroups(shapes=groups.shapes, groups=keyed, shape_only=shape_only)
    for indices in keyed.values():
        first = indices[:batch_size]
        got = batch_shape(collator([dataset[index] for index in first]))
        check_batch(got, regrouped.padded_shape(first), first, shape_only)
    return regrouped


def _one_rank(shapes: Sequence[Shape], name: str) -> bool:
    """Whether every sample holds the field ``name`` with one number of dimensions."""
    ranks = {len(dict(shape)[name]) if name in dict(shape) else None for shape in shapes}
    return len(ranks) == 1 and None not in ranks


def refuse_packing(dataset: Any, collator: Any) -> None:
    """Refuse a collator that packs several samples into one row (``DataCollatorWithFlattening``,
    TRL's ``padding_free=True``): the row concatenates the samples, with ``position_ids``
    restarting at each, and no padding. The trainer's shuffle packs each sample with other
    samples every epoch, so a row cached in one epoch stands for no sample in the next, and a
    per-sample cache has nothing to key. Found from the collated batch's rows (fewer than the
    samples given), not from the collator's class."""
    if len(dataset) < 2:
        return
    batch = collator([dataset[0], dataset[1]])
    rows = {name: value.shape[0] for name, value in batch.items() if _batched(value)}
    if not rows or 2 in rows.values():
        return
    name, count = next(iter(rows.items()))
    raise user_error(
        CacheError,
        f"The trainer's collator ({type(collator).__name__}) packs samples 0 and 1 into "
        f"{count} row ({name} of shape {tuple(batch[name].shape)}): a row holds several "
        "samples, and the trainer's shuffle packs each sample with others every epoch, so no "
        "cached row stands for one sample.",
        fix=Fix(
            "use a collator that gives each sample a row of its own (DataCollatorWithPadding, "
            "DataCollatorForSeq2Seq; TRL's SFTConfig: packing_strategy='wrapped' with "
            "packing=True, whose packed rows are padded dataset items, or padding_free=False "
            "without packing: TRL turns padding_free on for its default 'bfd' packing), or "
            "pack the dataset ahead so that each dataset item is one packed row"
        ),
    )


def _batched(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def check_batch(
    got: Shape, expected: Shape, indices: Sequence[int], shape_only: Iterable[str] = ()
) -> None:
    if got == expected:
        return
    longest = sorted(shape_only)
    shape_only_rule = (
        f"; {longest}, whose values the loss never reads, the longest of theirs" if longest else ""
    )
    raise user_error(
        CacheError,
        f"The trainer's collator pads samples {list(indices)[:8]} to {dict(got)} together, but "
        f"their padding alone gives {dict(expected)} (each field as each sample "
        f"alone{shape_only_rule}): its padding depends on more than the samples themselves, "
        "so graphsplit cannot group the samples into batches that pad each as when it was "
        "cached.",
        fix=UNGROUPABLE_FIX,
    )


class CachingBatches(torch.utils.data.Sampler[list[int]]):
    """The caching pass's batches: each group in dataset order, cut into ``batch_size``; a
    group's last, shorter batch is filled up with the group's first samples again, so every row
    is computed at ``batch_size``. A filler's index is ``index + repeat * size`` (``repeat`` >=
    1, ``size`` the dataset's): :class:`Indexed` reads item ``index`` for it, and its rows are
    stored under another key and never read."""

    def __init__(self, groups: PaddingGroups, batch_size: int) -> None:
        size = len(groups.shapes)
        self.batches: list[list[int]] = []
        for shape in sorted(groups.groups, key=repr):
            indices = groups.groups[shape]
            for begin in range(0, len(indices), batch_size):
                batch = indices[begin : begin + batch_size]
                fillers = range(batch_size - len(batch))
                batch += [indices[n % len(indices)] + (1 + n) * size for n in fillers]
                self.batches.append(batch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


@dataclass(frozen=True)
class IndexedItem:
    index: int
    repeat: int
    item: Any


class Indexed(torch.utils.data.Dataset):
    """``dataset[index + repeat * len(dataset)]``: item ``index`` with its index and repeat."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, at: int) -> IndexedItem:
        repeat, index = divmod(at, len(self.dataset))
        return IndexedItem(index, repeat, self.dataset[index])


class CheckedCollate:
    """The trainer's collator on a caching batch: the batch with a ``"key"`` per sample (the
    dataset index; a filler's ``"<index>~<repeat>"``), refused unless each sample got its
    group's shape."""

    def __init__(self, collator: Any, groups: PaddingGroups) -> None:
        self.collator = collator
        self.groups = groups

    def __call__(self, items: list[IndexedItem]) -> dict[str, Any]:
        batch = dict(self.collator([item.item for item in items]))
        indices = [item.index for item in items]
        groups = self.groups
        check_batch(batch_shape(batch), groups.padded_shape(indices), indices, groups.shape_only)
        batch["key"] = [
            str(item.index) if not item.repeat else f"{item.index}~{item.repeat}" for item in items
        ]
        return batch


def training_batches(trainer: Any, groups: PaddingGroups) -> BucketBatchSampler:
    """Every epoch's batches for all processes (accelerate gives each process its share, as it
    does the trainer's own sampler): the groups shuffled and cut with the trainer's seed."""
    args = trainer.args
    return BucketBatchSampler(
        groups.groups,
        trainer._train_batch_size,
        shuffle=args.train_sampling_strategy != "sequential",
        seed=args.data_seed if args.data_seed is not None else args.seed,
        drop_last=args.dataloader_drop_last,
        num_replicas=1,
        rank=0,
    )


def refuse_paired_rows(split: Any) -> None:
    """Refuse a split whose stage 2 pairs its batch's rows by position: the trainer's sampler
    (or :func:`training_batches`) batches the cached rows anew, which would pair wrong rows."""
    paired = getattr(split, "paired_rows", None)
    if paired is not None:
        raise regrouping_error(
            paired,
            "split_trainer's sampler (the trainer's, or one over padding groups)",
            (
                "cache with graphsplit.cache(split, loader, path) and train stage 2 in your own "
                "loop on graphsplit.CachedDataset(path, split).loader(batch_size=<the loader's "
                "batch size>), which reads the cached stage-1 batches whole"
            ),
        )


def _callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class GroupEpochs(_callback_base()):
    """Sets the batch sampler's epoch as each epoch begins: under several processes a resumed
    epoch's loader (accelerate's skip wrapper over its shard wrapper) does not reach it."""

    def __init__(self) -> None:
        self.sampler: BucketBatchSampler | None = None

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(int(state.epoch or 0))
