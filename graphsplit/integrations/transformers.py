"""Train a ``transformers.Trainer``'s own loss from a graphsplit cache, inside the trainer's loop.

Language-model users do not write the training loop: they subclass ``Trainer`` and override
``compute_loss`` (distillation calls a frozen teacher there). :func:`split_trainer` splits that
``compute_loss`` as it is, caches stage 1 over the train dataset through the trainer's own data
collator, and makes the trainer train stage 2 from the cache; everything else stays the
trainer's: its sampler (``group_by_length`` included), gradient accumulation, mixed precision,
DDP under ``accelerate launch``, logging, checkpoints and resume. Evaluation and prediction run
the unsplit ``compute_loss`` on raw batches.

Glossary:
    loss module (:class:`TrainerLoss`): ``compute_loss(model, inputs)`` as a module whose
        ``forward`` takes the collated batch; its children are the trainer's modules under
        their attribute names: the student as ``model`` (the trainer's name for it), a
        teacher as ``teacher``, a reference model as ``ref_model``.
    caching loader: the train dataset in dataset order, batched by
        ``per_device_train_batch_size`` through the trainer's collator (its unused columns
        removed as the trainer removes them); sample ``i`` of the cache is dataset item ``i``.
    cached batch (:class:`CachedBatch`): the rows of the samples the trainer's sampler picked,
        stacked by :func:`graphsplit.collate`; ``compute_loss`` runs stage 2 on it and the
        unsplit loss on anything else.
    cache record: ``graphsplit.json`` in every checkpoint folder (the cache's path and
        fingerprint); resuming from a checkpoint made with another cache is refused.

Exact: for the same seed the trainer's sampler picks the same samples in the same order as in
the unsplit run (it is built from the raw dataset, so ``group_by_length`` sees the raw lengths),
and stage 2 computes what ``compute_loss`` computes from the cached stage-1 values. A sample must
have the same shape in every batch it is collated in, since the cache stores rows and the
trainer's batches regroup them: where the collator pads each batch to its longest, every batch
(caching and training) holds samples it pads to one length (:mod:`.trainer_groups`), which
changes the batches' composition as ``group_by_length`` does.

In and out::

    parts = split_trainer(trainer, "cache/")   # -> TrainerSplit(split, cached, path, info)
    trainer.train()                            # stage 2 from the cache; resume as usual
    trainer.evaluate()                         # the unsplit compute_loss

    split_trainer(trainer, "cache/", cache_while_training=True)
    trainer.train()    # epoch 1: raw batches, stage 1 + stage 2, writes the cache; then from it

Cache while training (:class:`~graphsplit.LiveCache`): the first epoch's batches are the
trainer's own raw batches (its sampler and collator, exactly as unsplit) with the dataset
indices as sample keys; each runs stage 1 and stage 2 and stores its boundary. At the end of
the first epoch the cache is finished; later epochs read rows by dataset index. Every checkpoint
saved in the first epoch commits the rows computed so far, so resuming from it (a new
``split_trainer`` on the same folder) continues the cache where the checkpoint is.
"""

from __future__ import annotations

import contextlib
import json
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from graphsplit.api import Split
from graphsplit.caching import CachedDataset, CacheInfo, cache, collate
from graphsplit.caching.format.fingerprint import fingerprint
from graphsplit.caching.live import LiveCache
from graphsplit.errors import CacheError, Fix, SplitError, user_error
from graphsplit.integrations.trainer_accumulation import refuse_item_counted_accumulation
from graphsplit.integrations.trainer_bookkeeping import bookkeeping_kept
from graphsplit.integrations.trainer_checks import (
    caching_loader,
    check_live,
    check_trainer,
    dataset_and_collator,
    refuse_several_shapes,
)
from graphsplit.integrations.trainer_groups import (
    PaddingGroups,
    batch_shape,
    check_batch,
    refuse_paired_rows,
)
from graphsplit.integrations.trainer_live import LiveCacheSteps, LiveRows, RawItem
from graphsplit.integrations.trainer_loader import (
    batch_by_padded_length,
    epoch_callback,
    train_dataloader,
    trainer_padding_groups,
)
from graphsplit.integrations.trainer_loss import (
    TrainerLoss,
    checkpointing_as_train,
    neftune_as_train,
    originals,
    train_mode_as_train,
)
from graphsplit.integrations.trainer_regroup import plan_groups
from graphsplit.planning.rules.random_draws import generator_states, set_generator_states

__all__ = [
    "CachedBatch",
    "TrainerLoss",
    "TrainerSplit",
    "batch_by_padded_length",
    "split_trainer",
]

RECORD_NAME = "graphsplit.json"


class CachedBatch(dict):
    """A batch of cached rows (stage 2's keyword arguments), told apart from raw batches."""


class LiveBatch(dict):
    """A raw training batch of the first epoch with its sample keys (the dataset indices)."""


@dataclass(frozen=True)
class TrainerSplit:
    """What :func:`split_trainer` made: the split, the cache it wrote and reads."""

    split: Split
    cached: CachedDataset | None
    path: str
    info: CacheInfo | None
    live: LiveCache | None = None
    """Under ``cache_while_training``: the cache being written (``cached`` is ``None``)."""
    groups: PaddingGroups | None = None
    """Where the collator pads each batch to its longest: the samples grouped by the length it
    pads them to (every batch holds one group's samples); ``None``: one shape for all."""


def split_trainer(
    trainer: Any,
    cache_dir: str | os.PathLike[str],
    *,
    storage_dtype: torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool | None = False,
    cache_while_training: bool = False,
) -> TrainerSplit:
    """Split ``trainer.compute_loss``, cache stage 1 over its train dataset, train from the cache.

    After this call ``trainer.train()`` trains stage 2 from the cache with the trainer's own
    sampler, gradient accumulation, mixed precision, DDP and checkpoints; ``evaluate`` and
    ``predict`` still run the unsplit ``compute_loss``. Under ``accelerate launch`` every process
    calls it: each computes and writes its share of the cache, then all wait for the whole.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) with a map-style ``train_dataset``.
            Frozen modules are those with ``requires_grad=False``.
        cache_dir: the cache folder (or an fsspec URL); caching again with the same weights,
            code and samples reuses it.
        storage_dtype: as in :func:`graphsplit.cache` (``None``: lossless).
        overwrite: replace a cache made from other weights, code or options.
        progress: show the caching progress bar.
        cache_while_training: no caching pass: the first epoch trains on raw batches (stage 1
            and stage 2, the unsplit losses bit for bit) and writes the cache as it goes; later
            epochs train from it. Needs ``dataloader_drop_last=False`` and no persistent
            workers; under ``accelerate launch`` each process writes its share.

    Returns:
        :class:`TrainerSplit`.

    Raises:
        SplitError: the trainer is TRL's ``DPOTrainer`` (its tool is
            :func:`graphsplit.integrations.trl.cache_reference_log_probs`) or ``KTOTrainer``,
            has no map-style train dataset, builds its batches itself
            (overrides ``_prepare_inputs``, ``get_train_dataloader`` or ``_get_train_sampler``,
            as TRL's on-policy distillation trainers do), or uses a sampling strategy that
            regroups batches itself (``batch_rebalance``).
        CacheError: the collator's padding depends on more than the samples themselves (not
            their own length, that rounded up, or one length for all).

    Padding to the batch's longest (``DataCollatorWithPadding``'s default, TRL's collators):
    the samples are grouped by the length the collator pads each alone to, and the trainer's
    sampler is replaced by a seeded, shuffled :class:`~graphsplit.BucketBatchSampler` over the
    groups (every batch holds one group's samples; accelerate shards it across processes), in
    the caching pass and every epoch, so each sample is padded as when it was cached. The batch
    composition differs from the trainer's own sampler's, as with ``group_by_length``;
    :func:`batch_by_padded_length` gives an unsplit trainer the same batches.

    Example:
        >>> parts = split_trainer(trainer, "cache/")   # doctest: +SKIP
        >>> trainer.train()                            # doctest: +SKIP
    """
    # The trainer seeded the generators in __init__; its sampler (group_by_length draws from
    # the global generator) must find them as the unsplit run does. Taken before the checks:
    # their first import of TRL imports rich, which draws from Python's generator.
    states = generator_states()
    try:
        check_trainer(trainer)
    finally:
        set_generator_states(states)
    checkpointing_as_train(trainer)  # the plan must see the layers train() checkpoints
    if cache_while_training:
        return _split_live(trainer, cache_dir, storage_dtype, overwrite)
    try:
        groups = trainer_padding_groups(trainer)
        # The probes and stage 1 run the trainer's compute_loss: its counts and logged
        # metrics (TRL's) must not include them.
        with bookkeeping_kept(trainer), neftune_as_train(trainer), train_mode_as_train(trainer):
            parts, cached, info, groups = _split_and_cache(
                trainer, groups, cache_dir, storage_dtype, overwrite, progress
            )
    finally:
        set_generator_states(states)
    path = str(cache_dir)
    made = cached.manifest.header.fingerprint
    _train_from_cache(trainer, parts, _CachedRows(cached, groups), path, made, groups)
    return TrainerSplit(split=parts, cached=cached, path=path, info=info, groups=groups)


def _split_and_cache(
    trainer: Any,
    groups: PaddingGroups | None,
    cache_dir: str | os.PathLike[str],
    storage_dtype: torch.dtype | None,
    overwrite: bool,
    progress: bool | None,
) -> tuple[Split, CachedDataset, CacheInfo | None, PaddingGroups | None]:
    """Split on the first caching batch, key the groups without the shape-only fields
    (:mod:`.trainer_regroup`), and cache stage 1 in the final groups' batches."""
    planned = plan_groups(trainer, groups)
    parts, groups = planned.split, planned.groups
    refuse_paired_rows(parts)
    compute_loss = planned.loss._compute_loss
    refuse_item_counted_accumulation(trainer, planned.example, parts.boundary, compute_loss)
    accelerator = trainer.accelerator
    info = cache(
        parts,
        caching_loader(trainer, groups),
        cache_dir,
        accelerator=accelerator if accelerator.num_processes > 1 else None,
        storage_dtype=storage_dtype,
        overwrite=overwrite,
        progress=progress,
    )
    accelerator.wait_for_everyone()
    cached = CachedDataset(cache_dir, parts)
    if groups is None:
        refuse_several_shapes(cached)
    return parts, cached, info, groups


def _split_live(
    trainer: Any,
    cache_dir: str | os.PathLike[str],
    storage_dtype: torch.dtype | None,
    overwrite: bool,
) -> TrainerSplit:
    """``cache_while_training``: split, open the live cache, and train epoch 1 on raw batches."""
    check_live(trainer)
    states = generator_states()
    try:
        # train() attaches the hook again before the first step, and sets training mode
        with neftune_as_train(trainer), train_mode_as_train(trainer):
            planned = plan_groups(trainer, trainer_padding_groups(trainer))
        parts, groups = planned.split, planned.groups
        refuse_paired_rows(parts)
        compute_loss = planned.loss._compute_loss
        refuse_item_counted_accumulation(trainer, planned.example, parts.boundary, compute_loss)
    finally:
        set_generator_states(states)
    accelerator = trainer.accelerator
    live = LiveCache(
        parts,
        cache_dir,
        accelerator=accelerator if accelerator.num_processes > 1 else None,
        storage_dtype=storage_dtype,
        overwrite=overwrite,
    )
    path = str(cache_dir)
    raw, _ = dataset_and_collator(trainer, "Training")
    rows = LiveRows(live, len(raw), grouped=groups is not None)
    made = fingerprint(parts)
    _train_from_cache(trainer, parts, rows, path, made, groups, live=live)
    return TrainerSplit(split=parts, cached=None, path=path, info=None, live=live, groups=groups)


# -- training from the cache ---------------------------------------------------------------------
class _CachedRows(Dataset):
    """Index ``i``: sample ``i``'s cached rows (dataset item ``i``; in a cache of padding
    groups, the rows keyed ``str(i)``)."""

    def __init__(self, cached: CachedDataset, groups: PaddingGroups | None) -> None:
        self.cached = cached
        self.rows = None if groups is None else {k: i for i, k in enumerate(cached.keys)}
        self.size = len(cached) if groups is None else len(groups.shapes)  # fillers left out

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        return self.cached[index if self.rows is None else self.rows[str(index)]]


class _Collate:
    """Cached rows -> :class:`CachedBatch`; raw items -> the trainer's collator's batch, keyed
    (and, in padding groups, checked to pad each sample to its group's shape)."""

    def __init__(self, collator: Any = None, groups: PaddingGroups | None = None) -> None:
        self.collator = collator
        self.groups = groups

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        groups = self.groups
        if not items or not isinstance(items[0], RawItem):
            cached = CachedBatch(collate(items))
            if groups is not None and groups.shape_only:  # as the collator pads this batch
                cached.update(groups.shape_rows([int(item["key"]) for item in items]))
            return cached
        batch = LiveBatch(self.collator([item.item for item in items]))
        indices = [item.index for item in items]
        if groups is not None:
            check_batch(
                batch_shape(batch), groups.padded_shape(indices), indices, groups.shape_only
            )
        batch["key"] = [str(index) for index in indices]
        return batch


def _train_from_cache(
    trainer: Any,
    parts: Split,
    rows: Dataset,
    path: str,
    made: Any,
    groups: PaddingGroups | None,
    live: LiveCache | None = None,
) -> None:
    """Point the trainer's train dataloader at the cache, and its training loss at stage 2."""
    _, collator = dataset_and_collator(trainer, "Training")
    trainer.get_train_dataloader = types.MethodType(
        partial(
            train_dataloader,
            rows=rows,
            collate=_Collate(collator, groups),
            groups=groups,
            epochs=epoch_callback(trainer) if groups is not None else None,
            live=rows if isinstance(rows, LiveRows) else None,
        ),
        trainer,
    )
    own = originals(trainer)  # a second split_trainer wraps the trainer's own methods
    unsplit = own["compute_loss"]

    def compute_loss(
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if isinstance(inputs, LiveBatch):
            assert live is not None
            with _student_called_as(parts.stage2, model, trainer.model):
                loss = live.step(inputs)
            return (loss, None) if return_outputs else loss
        if not isinstance(inputs, CachedBatch):  # evaluation, prediction: raw batches
            return unsplit(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        with _student_called_as(parts.stage2, model, trainer.model):
            loss = parts.stage2(**inputs)
        return (loss, None) if return_outputs else loss

    trainer.compute_loss = compute_loss
    record = {
        "cache": path,
        "fingerprint": {"code": made.code, "weights": made.weights, "boundary": made.boundary},
    }
    trainer.remove_callback(_CacheRecord)
    trainer.add_callback(_CacheRecord(record))
    trainer.remove_callback(LiveCacheSteps)
    if live is not None:
        assert isinstance(rows, LiveRows)
        trainer.add_callback(LiveCacheSteps(rows))
    train = own["train"]

    def train_checked(resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            _check_record(trainer, resume_from_checkpoint, record)
        return train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    trainer.train = train_checked


@contextlib.contextmanager
def _student_called_as(stage2: nn.Module, wrapped: nn.Module, student: nn.Module) -> Iterator[None]:
    """Stage 2 calls the student through the trainer's wrapper (DDP syncs gradients there)."""
    if wrapped is student:
        yield
        return
    if stage2._modules.get("model") is not student:
        raise user_error(
            SplitError,
            f"The trainer wraps the student in {type(wrapped).__name__}, but stage 2 does not "
            "call the student as one module (graphsplit traced into it: part of it is frozen, "
            "as in a LoRA'd model), so the wrapper's forward, which syncs gradients, would be "
            "skipped.",
            fix=Fix(
                "train this split in one process, or freeze the student's frozen part into a "
                "separate module the loss calls before the student"
            ),
        )
    stage2._modules["model"] = wrapped
    try:
        yield
    finally:
        stage2._modules["model"] = student


# -- checkpoints ----------------------------------------------------------------------------------
def _checkpoint_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class _CacheRecord(_checkpoint_callback_base()):
    """Writes the cache record into every checkpoint folder the trainer saves."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / RECORD_NAME).write_text(json.dumps(self.record, indent=1, sort_keys=True))


def _check_record(trainer: Any, resume: Any, record: dict[str, Any]) -> None:
    """Refuse resuming from a checkpoint trained from another cache (or from none)."""
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(trainer.args.output_dir)
        if resume is None:
            return  # the trainer says there is no checkpoint
    saved_path = Path(resume) / RECORD_NAME
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else None
    if saved == record:
        return
    what = (
        "was not trained from a graphsplit cache"
        if saved is None
        else f"was trained from the cache {saved['cache']!r} with other weights, code or boundary"
        if saved["cache"] == record["cache"]
        else f"was trained from the cache {saved['cache']!r}"
    )
    raise user_error(
        CacheError,
        f"The checkpoint {str(resume)!r} {what}, not from {record['cache']!r} as split now.",
        fix=Fix(
            "resume with the cache and models the checkpoint was trained with, or start a new "
            "run (a different output_dir)"
        ),
    )
