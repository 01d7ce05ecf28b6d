"""What :func:`graphsplit.integrations.transformers.split_trainer` checks before it runs a model.

A trainer is refused up front where its cache could not stand in for the unsplit run: a
trainer that builds its own batches (on-policy distillation generates them during training),
a train dataset without indices, a collator that pads each batch to its longest sample (the
sampler regroups samples every epoch, so a row cached at one batch's length cannot stand in
for the sample in another), and options a first epoch that writes the cache cannot honour.
Kept apart from the integration itself so that each file has one job: what is refused and
why here, how the trainer trains from the cache there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from graphsplit.caching import CachedDataset
from graphsplit.errors import CacheError, Fix, SplitError, user_error

__all__ = [
    "BATCH_BUILDING_METHODS",
    "SHAPE_CHECK_BATCHES",
    "batch_building_methods",
    "caching_loader",
    "check_live",
    "check_trainer",
    "dataset_and_collator",
    "refuse_padding_to_the_batch",
    "refuse_several_shapes",
]


def check_live(trainer: Any) -> None:
    args = trainer.args
    refusals = [
        (
            args.dataloader_drop_last,
            "needs dataloader_drop_last=False: the first epoch must see every sample, since "
            "later epochs' shuffles drop other ones",
            "set dataloader_drop_last=False, or cache first without cache_while_training",
        ),
        (
            args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
            "cannot use persistent dataloader workers: they would keep loading raw batches "
            "after the first epoch",
            "set dataloader_persistent_workers=False",
        ),
    ]
    for refused, why, fix in refusals:
        if refused:
            raise user_error(SplitError, f"cache_while_training {why}.", fix=Fix(fix))


def caching_loader(trainer: Any) -> DataLoader:
    """The train dataset in order, through the trainer's collator (unused columns removed)."""
    dataset, collator = dataset_and_collator(trainer, "graphsplit cache")
    return DataLoader(
        dataset,
        batch_size=trainer.args.per_device_train_batch_size,
        shuffle=False,
        collate_fn=collator,
        num_workers=trainer.args.dataloader_num_workers,
    )


def dataset_and_collator(trainer: Any, description: str) -> tuple[Any, Any]:
    """The train dataset and collator as the trainer's own dataloader sees them."""
    dataset, collator = trainer.train_dataset, trainer.data_collator
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of transformers' extras
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description=description)
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description=description)
    return dataset, collator


def check_trainer(trainer: Any) -> None:
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        raise user_error(
            SplitError,
            "split_trainer needs the trainer's train_dataset as a map-style dataset (one item "
            f"per index), not {type(dataset).__name__}: the cache stores sample i at index i.",
            fix=Fix("pass train_dataset=... to the Trainer (a datasets.Dataset or a list)"),
        )
    own = batch_building_methods(type(trainer))
    if own:
        raise user_error(
            SplitError,
            f"{type(trainer).__name__} builds its training batches itself ({', '.join(own)} "
            "overridden; TRL's on-policy DistillationTrainer / GKDTrainer generate the "
            "completions with the student there): what the frozen model sees is made during "
            "training, so its outputs cannot be cached before, and split_trainer would replace "
            "that batch building.",
            fix=Fix(
                "distil on fixed completions instead: subclass Trainer or trl.SFTTrainer with a "
                "compute_loss that calls the frozen teacher (docs/howto.md, 'Distillation with "
                "a Trainer')"
            ),
        )
    if getattr(trainer, "lmbda", 0) or getattr(trainer, "seq_kd", False):
        raise user_error(
            SplitError,
            f"{type(trainer).__name__} trains on-policy (lmbda={getattr(trainer, 'lmbda', 0)}, "
            f"seq_kd={getattr(trainer, 'seq_kd', False)}): its training step replaces batches "
            "with the student's or the teacher's generations, so what the frozen teacher sees is "
            "made during training and cannot be cached before.",
            fix=Fix(
                "distil on fixed completions: a Trainer or trl.SFTTrainer subclass whose "
                "compute_loss calls the frozen teacher (docs/howto.md, 'Distillation with a "
                "Trainer')"
            ),
        )
    strategy = getattr(trainer.args, "train_sampling_strategy", "random")
    if strategy == "batch_rebalance":
        raise user_error(
            SplitError,
            "split_trainer does not support train_sampling_strategy='batch_rebalance': its "
            "batches are regrouped per process from the raw samples' lengths.",
            fix=Fix("use train_sampling_strategy='random' or 'group_by_length'"),
        )


# Batches the collator check looks at before anything runs (collation only, no model).
SHAPE_CHECK_BATCHES = 64


# The Trainer methods through which a trainer makes its own training batches.
BATCH_BUILDING_METHODS = ("_prepare_inputs", "get_train_dataloader", "_get_train_sampler")


def batch_building_methods(trainer_class: type) -> list[str]:
    """The batch-building methods ``trainer_class`` overrides (``Trainer``'s own: none)."""
    from transformers import Trainer

    return [
        name
        for name in BATCH_BUILDING_METHODS
        if getattr(trainer_class, name, None) is not getattr(Trainer, name, None)
    ]


def refuse_padding_to_the_batch(trainer: Any) -> None:
    """Refuse, before any model runs, a collator whose sample shapes depend on the batch.

    A sample padded to its batch's longest has rows (its inputs, the teacher's logits) as long
    as that batch; the trainer's sampler puts it in other batches every epoch, where the unsplit
    run pads it to other lengths, and the loss sees every padded position (a KL over all
    positions, a mean over the padded length). Those rows cannot stand in for it. Looks at the
    first ``SHAPE_CHECK_BATCHES`` batches of the caching loader; the cache itself is checked
    again once written (:func:`refuse_several_shapes`).
    """
    loader = caching_loader(trainer)
    seen: dict[tuple[tuple[str, tuple[int, ...]], ...], None] = {}
    for number, batch in enumerate(loader):
        if number == SHAPE_CHECK_BATCHES:
            break
        shape = tuple(
            (str(name), tuple(value.shape[1:]))
            for name, value in batch.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        )
        seen.setdefault(shape, None)
        if len(seen) > 1:
            first, other = (dict(one) for one in list(seen)[:2])
            raise padding_error(len(seen), first, other)


def refuse_several_shapes(cached: CachedDataset) -> None:
    shapes = cached.buckets()
    if len(shapes) <= 1:
        return
    names = list(cached.collation.order)
    examples = [dict(zip(names, shape)) for shape in list(shapes)[:2]]
    raise padding_error(len(shapes), examples[0], examples[1])


def padding_error(count: int, first: Any, other: Any) -> CacheError:
    return user_error(
        CacheError,
        f"The trainer's collator gives samples {count} different shapes in different batches "
        f"(e.g. {first} and {other}): it pads each batch to its longest sample. The trainer's "
        "sampler puts every sample in other batches each epoch, where the unsplit run pads it "
        "to other lengths, so rows cached at one batch's length cannot stand in for it.",
        fix=Fix(
            "pad every sample to one length, e.g. DataCollatorWithPadding(tokenizer, "
            "padding='max_length', max_length=N) or tokenizer(..., padding='max_length', "
            "max_length=N); group_by_length still orders by the unpadded lengths"
        ),
    )
