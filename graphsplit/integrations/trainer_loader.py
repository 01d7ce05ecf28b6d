"""The train dataloader :func:`~graphsplit.integrations.transformers.split_trainer` gives a
trainer: its own sampler over the cached rows (or, in padding groups, the groups' batches), and
:func:`batch_by_padded_length`, which gives an unsplit trainer the same batches.

Apart from the integration so that each module keeps one job: which batches the trainer trains
here, what it trains them with there.
"""

from __future__ import annotations

import types
from functools import partial
from typing import Any

from torch.utils.data import DataLoader, Dataset

from graphsplit.integrations.trainer_bookkeeping import bookkeeping_kept
from graphsplit.integrations.trainer_checks import check_trainer, dataset_and_collator
from graphsplit.integrations.trainer_groups import (
    GroupEpochs,
    PaddingGroups,
    padding_groups,
    training_batches,
)
from graphsplit.integrations.trainer_live import LiveRows
from graphsplit.integrations.trainer_regroup import plan_groups
from graphsplit.planning.rules.random_draws import generator_states, set_generator_states

__all__ = ["batch_by_padded_length", "epoch_callback", "train_dataloader", "trainer_padding_groups"]


def batch_by_padded_length(trainer: Any) -> PaddingGroups | None:
    """Make an unsplit trainer train on the batches ``split_trainer`` makes for it.

    When the trainer's collator pads each batch to its longest, ``split_trainer`` trains
    batches of samples padded to one length (see :mod:`~graphsplit.integrations.trainer_groups`);
    this gives an unsplit trainer the same batches (same seed, same order), e.g. to compare its
    losses with the split run's. Returns the groups, or ``None`` (the collator gives every sample
    one shape: the trainer's own sampler stays). Where the collator pads several lengths, the
    trainer's loss is split on one batch (as ``split_trainer`` splits it) to find the fields
    it reads only the shape of (:mod:`~graphsplit.integrations.trainer_regroup`).
    """
    check_trainer(trainer)
    states = generator_states()
    try:
        groups = trainer_padding_groups(trainer)
        if groups is not None:  # split_trainer's groups are known once the loss is split
            with bookkeeping_kept(trainer):
                groups = plan_groups(trainer, groups).groups
    finally:
        set_generator_states(states)
    if groups is not None:
        raw, collator = dataset_and_collator(trainer, "Training")
        epochs = epoch_callback(trainer)
        trainer.get_train_dataloader = types.MethodType(
            partial(train_dataloader, rows=raw, collate=collator, groups=groups, epochs=epochs),
            trainer,
        )
    return groups


def trainer_padding_groups(trainer: Any) -> PaddingGroups | None:
    raw, collator = dataset_and_collator(trainer, "graphsplit cache")
    return padding_groups(raw, collator, trainer._train_batch_size)


def epoch_callback(trainer: Any) -> GroupEpochs:
    trainer.remove_callback(GroupEpochs)
    epochs = GroupEpochs()
    trainer.add_callback(epochs)
    return epochs


def train_dataloader(
    trainer: Any,
    *,
    rows: Dataset,
    collate: Any,
    groups: PaddingGroups | None,
    epochs: GroupEpochs | None,
    live: LiveRows | None = None,
) -> DataLoader:
    """``Trainer.get_train_dataloader`` over the cache: the trainer's sampler, built from the
    raw dataset (the same order and length groups as the unsplit run), picks the rows (or,
    while a live cache is written, the raw items); in padding groups, the groups' batches."""
    args = trainer.args
    raw, _ = dataset_and_collator(trainer, "Training")
    if live is not None:
        live.raw = raw
    batching: dict[str, Any]
    if groups is None:
        batching = {
            "batch_size": trainer._train_batch_size,
            "sampler": trainer._get_train_sampler(raw),
            "drop_last": args.dataloader_drop_last,
        }
    else:
        assert epochs is not None
        epochs.sampler = training_batches(trainer, groups)
        batching = {"batch_sampler": epochs.sampler}
    loader = DataLoader(
        rows,
        collate_fn=collate,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
        worker_init_fn=partial(
            _seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        ),
        **batching,
    )
    return trainer.accelerator.prepare(loader)


def _seed_worker(worker_id: int, num_workers: int, rank: int) -> None:
    from transformers.trainer_utils import seed_worker

    seed_worker(worker_id, num_workers=num_workers, rank=rank)
