"""What :func:`graphsplit.integrations.transformers.split_trainer` checks before it runs a model.

A trainer is refused up front where its cache could not stand in for the unsplit run: TRL's
preference trainers (:mod:`.trl_checks`), a trainer that builds its own batches (on-policy
distillation generates them during training), a train dataset without indices, a collator
whose padding depends on more than the samples themselves (a row cached at one batch's padding
cannot stand in for the sample in another; padding to the batch's longest is grouped instead,
:mod:`.trainer_groups`), and options a first epoch that writes the cache cannot honour.
Kept apart from the integration itself so that each file has one job: what is refused and
why here, how the trainer trains from the cache there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from graphsplit.caching import CachedDataset
from graphsplit.errors import CacheError, Fix, SplitError, user_error
from graphsplit.integrations.trainer_groups import (
    UNGROUPABLE_FIX,
    CachingBatches,
    CheckedCollate,
    Indexed,
    PaddingGroups,
)
from graphsplit.integrations.trl_checks import is_a, refuse_preference_trainers

__all__ = [
    "BATCH_BUILDING_METHODS",
    "batch_building_methods",
    "caching_loader",
    "check_live",
    "check_trainer",
    "dataset_and_collator",
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


def caching_loader(trainer: Any, groups: PaddingGroups | None = None) -> DataLoader:
    """The train dataset in order, through the trainer's collator (unused columns removed); in
    padding groups, the groups' caching batches, each sample keyed by its dataset index."""
    dataset, collator = dataset_and_collator(trainer, "graphsplit cache")
    if groups is not None:
        return DataLoader(
            Indexed(dataset),
            batch_sampler=CachingBatches(groups, trainer._train_batch_size),
            collate_fn=CheckedCollate(collator, groups),
            num_workers=trainer.args.dataloader_num_workers,
        )
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
    refuse_preference_trainers(trainer)  # before the others: its own reason, its own tool
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        raise user_error(
            SplitError,
            "split_trainer needs the trainer's train_dataset as a map-style dataset (one item "
            f"per index), not {type(dataset).__name__}: the cache stores sample i at index i.",
            fix=Fix("pass train_dataset=... to the Trainer (a datasets.Dataset or a list)"),
        )
    own = batch_building_methods(type(trainer))
    if own and any(is_a(trainer, name) for name in ON_POLICY_RL_TRAINERS):
        raise user_error(
            SplitError,
            f"{type(trainer).__name__} builds its training batches itself ({', '.join(own)} "
            "overridden): every step the policy generates completions there, and its reward "
            "and its ref_model score them. What the frozen reference sees is made by the "
            "policy during training, so nothing of it can be cached before.",
            fix=Fix(
                "train it as it is; for an offline objective over fixed completions, "
                "trl.DPOTrainer with graphsplit.integrations.trl.cache_reference_log_probs "
                "caches the reference"
            ),
        )
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
    refuse_a_teacher_it_cannot_cache(trainer)
    strategy = getattr(trainer.args, "train_sampling_strategy", "random")
    if strategy == "batch_rebalance":
        raise user_error(
            SplitError,
            "split_trainer does not support train_sampling_strategy='batch_rebalance': its "
            "batches are regrouped per process from the raw samples' lengths.",
            fix=Fix("use train_sampling_strategy='random' or 'group_by_length'"),
        )


TEACHER_FIX = Fix(
    "freeze the teacher and call it without a KV cache before split_trainer: "
    "trainer.teacher_model.requires_grad_(False); trainer.teacher_model.config.use_cache = False"
)


def refuse_a_teacher_it_cannot_cache(trainer: Any) -> None:
    """TRL's ``GKDTrainer`` (``lmbda=0``) runs its ``teacher_model`` under ``no_grad`` but leaves
    it trainable (graphsplit caches frozen modules' work only) and lets it return a KV cache
    (a ``DynamicCache``, not a tensor a cache can store)."""
    teacher = getattr(trainer, "teacher_model", None)
    if not isinstance(teacher, torch.nn.Module):
        return
    trainable = any(parameter.requires_grad for parameter in teacher.parameters())
    caching = bool(getattr(getattr(teacher, "config", None), "use_cache", False))
    if not trainable and not caching:
        return
    what = (
        "has trainable parameters (it runs under no_grad, but is not frozen)"
        if trainable
        else ("returns a KV cache (config.use_cache=True), which is not a tensor a cache can store")
    )
    raise user_error(
        SplitError,
        f"{type(trainer).__name__}'s teacher_model {what}: split_trainer caches the work of "
        "frozen modules whose outputs are tensors.",
        fix=TEACHER_FIX,
    )


# TRL's trainers whose policy generates the completions its reference and rewards score.
ON_POLICY_RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "PPOTrainer", "OnlineDPOTrainer")

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
        f"(e.g. {first} and {other}), although it gives every sample alone one shape: its "
        "padding depends on more than the samples themselves, so rows cached in one batch "
        "cannot stand in for the samples in the batches the trainer's sampler makes.",
        fix=UNGROUPABLE_FIX,
    )
