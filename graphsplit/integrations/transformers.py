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
and stage 2 computes what ``compute_loss`` computes from the cached stage-1 values. Every sample
must have the same shape whatever batch it is collated in (pad to one length), since the cache
stores rows and the trainer's batches regroup them.

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
from torch.utils.data import DataLoader, Dataset

from graphsplit.api import Split, split
from graphsplit.caching import CachedDataset, CacheInfo, cache, collate
from graphsplit.caching.format.fingerprint import fingerprint
from graphsplit.caching.live import LiveCache
from graphsplit.errors import CacheError, Fix, SplitError, user_error
from graphsplit.planning.rules.random_draws import generator_states, set_generator_states

__all__ = ["CachedBatch", "TrainerLoss", "TrainerSplit", "split_trainer"]

RECORD_NAME = "graphsplit.json"


class TrainerLoss(nn.Module):
    """A trainer's ``compute_loss(model, inputs)`` as a module that takes the collated batch.

    Children: the student as ``model``, then every other module the trainer holds as an
    attribute (a teacher, a reference model) under that attribute's name, each object once
    (``model_wrapped`` is the student before training). The trainer itself is kept as a plain
    attribute: it holds the student again in its callback handler, which must not name it.
    """

    def __init__(self, trainer: Any) -> None:
        super().__init__()
        self.model = trainer.model
        for name, value in vars(trainer).items():
            if not isinstance(value, nn.Module) or not name.isidentifier():
                continue
            if name.startswith("_") or any(value is child for child in self.children()):
                continue
            self.add_module(name, value)
        object.__setattr__(self, "_compute_loss", _originals(trainer)["compute_loss"])

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        return self._compute_loss(self.model, inputs)


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
        SplitError: the trainer has no map-style train dataset, builds its batches itself
            (overrides ``_prepare_inputs``, ``get_train_dataloader`` or ``_get_train_sampler``,
            as TRL's on-policy distillation trainers do), or uses a sampling strategy that
            regroups batches itself (``batch_rebalance``).
        CacheError: the collator gives samples different shapes in different batches.

    Example:
        >>> parts = split_trainer(trainer, "cache/")   # doctest: +SKIP
        >>> trainer.train()                            # doctest: +SKIP
    """
    _check_trainer(trainer)
    if cache_while_training:
        return _split_live(trainer, cache_dir, storage_dtype, overwrite)
    # The trainer seeded the generators in __init__; its sampler (group_by_length draws from
    # the global generator) must find them as the unsplit run does.
    states = generator_states()
    try:
        parts, cached, info = _split_and_cache(
            trainer, cache_dir, storage_dtype, overwrite, progress
        )
    finally:
        set_generator_states(states)
    path = str(cache_dir)
    made = cached.manifest.header.fingerprint
    _train_from_cache(trainer, parts, _CachedRows(cached), path, made)
    return TrainerSplit(split=parts, cached=cached, path=path, info=info)


def _split_and_cache(
    trainer: Any,
    cache_dir: str | os.PathLike[str],
    storage_dtype: torch.dtype | None,
    overwrite: bool,
    progress: bool | None,
) -> tuple[Split, CachedDataset, CacheInfo | None]:
    _refuse_padding_to_the_batch(trainer)
    loss = TrainerLoss(trainer)
    loader = caching_loader(trainer)
    example = next(iter(loader))
    parts = split(loss, (example,))
    accelerator = trainer.accelerator
    info = cache(
        parts,
        loader,
        cache_dir,
        accelerator=accelerator if accelerator.num_processes > 1 else None,
        storage_dtype=storage_dtype,
        overwrite=overwrite,
        progress=progress,
    )
    accelerator.wait_for_everyone()
    cached = CachedDataset(cache_dir, parts)
    _refuse_several_shapes(cached)
    return parts, cached, info


def _split_live(
    trainer: Any,
    cache_dir: str | os.PathLike[str],
    storage_dtype: torch.dtype | None,
    overwrite: bool,
) -> TrainerSplit:
    """``cache_while_training``: split, open the live cache, and train epoch 1 on raw batches."""
    _check_live(trainer)
    states = generator_states()
    try:
        _refuse_padding_to_the_batch(trainer)
        example = next(iter(caching_loader(trainer)))
        parts = split(TrainerLoss(trainer), (example,))
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
    raw, _ = _dataset_and_collator(trainer, "Training")
    rows = _LiveRows(live, len(raw))
    made = fingerprint(parts)
    _train_from_cache(trainer, parts, rows, path, made, live=live)
    return TrainerSplit(split=parts, cached=None, path=path, info=None, live=live)


def _check_live(trainer: Any) -> None:
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
    dataset, collator = _dataset_and_collator(trainer, "graphsplit cache")
    return DataLoader(
        dataset,
        batch_size=trainer.args.per_device_train_batch_size,
        shuffle=False,
        collate_fn=collator,
        num_workers=trainer.args.dataloader_num_workers,
    )


def _dataset_and_collator(trainer: Any, description: str) -> tuple[Any, Any]:
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


def _check_trainer(trainer: Any) -> None:
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        raise user_error(
            SplitError,
            "split_trainer needs the trainer's train_dataset as a map-style dataset (one item "
            f"per index), not {type(dataset).__name__}: the cache stores sample i at index i.",
            fix=Fix("pass train_dataset=... to the Trainer (a datasets.Dataset or a list)"),
        )
    own = _batch_building_methods(type(trainer))
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


def _batch_building_methods(trainer_class: type) -> list[str]:
    """The batch-building methods ``trainer_class`` overrides (``Trainer``'s own: none)."""
    from transformers import Trainer

    return [
        name
        for name in BATCH_BUILDING_METHODS
        if getattr(trainer_class, name, None) is not getattr(Trainer, name, None)
    ]


def _refuse_padding_to_the_batch(trainer: Any) -> None:
    """Refuse, before any model runs, a collator whose sample shapes depend on the batch.

    A sample padded to its batch's longest has rows (its inputs, the teacher's logits) as long
    as that batch; the trainer's sampler puts it in other batches every epoch, where the unsplit
    run pads it to other lengths, and the loss sees every padded position (a KL over all
    positions, a mean over the padded length). Those rows cannot stand in for it. Looks at the
    first ``SHAPE_CHECK_BATCHES`` batches of the caching loader; the cache itself is checked
    again once written (:func:`_refuse_several_shapes`).
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
            raise _padding_error(len(seen), first, other)


def _refuse_several_shapes(cached: CachedDataset) -> None:
    shapes = cached.buckets()
    if len(shapes) <= 1:
        return
    names = list(cached.collation.order)
    examples = [dict(zip(names, shape)) for shape in list(shapes)[:2]]
    raise _padding_error(len(shapes), examples[0], examples[1])


def _padding_error(count: int, first: Any, other: Any) -> CacheError:
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


# -- training from the cache ---------------------------------------------------------------------
class _CachedRows(Dataset):
    """Index ``i``: sample ``i``'s cached rows (dataset item ``i``)."""

    def __init__(self, cached: CachedDataset) -> None:
        self.cached = cached

    def __len__(self) -> int:
        return len(self.cached)

    def __getitem__(self, index: int) -> Any:
        return self.cached[index]


class _LiveRows(Dataset):
    """Index ``i``: dataset item ``i`` with its index while the live cache is being written
    (epoch 1), then sample ``i``'s cached rows (the cache names it ``str(i)``).

    The switch is read when an epoch's iteration starts (workers copy the dataset then)."""

    def __init__(self, live: LiveCache, size: int) -> None:
        self.live = live
        self.size = size
        self.raw: Any = None  # the trainer's raw dataset, set by the dataloader
        self.cached: CachedDataset | None = None
        self.rows: dict[str, int] = {}
        if live.complete:
            self.switch()

    def switch(self) -> None:
        """From now on: the cached rows (every sample's, else refused)."""
        cached = self.live.dataset()
        rows = {key: index for index, key in enumerate(cached.keys)}
        missing = [index for index in range(self.size) if str(index) not in rows]
        if missing:
            raise user_error(
                CacheError,
                f"the cache at {self.live.path} lacks {len(missing)} of the {self.size} "
                f"samples (dataset indices {missing[:5]}...) after the first epoch: it was "
                "resumed from a checkpoint whose rows were not committed to this folder.",
                fix=Fix(
                    "resume with the cache folder the checkpoint was trained with, or start "
                    "afresh with overwrite=True and a new output_dir"
                ),
            )
        self.cached, self.rows = cached, rows

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        if self.cached is None:
            return _RawItem(index, self.raw[index])
        return self.cached[self.rows[str(index)]]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "live": None}  # spawned workers need no writer


@dataclass(frozen=True)
class _RawItem:
    index: int
    item: Any


class _Collate:
    """Cached rows -> :class:`CachedBatch`; raw items -> the trainer's collator's batch, keyed."""

    def __init__(self, collator: Any = None) -> None:
        self.collator = collator

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        if not items or not isinstance(items[0], _RawItem):
            return CachedBatch(collate(items))
        batch = LiveBatch(self.collator([item.item for item in items]))
        batch["key"] = [str(item.index) for item in items]
        return batch


def _train_from_cache(
    trainer: Any,
    parts: Split,
    rows: Dataset,
    path: str,
    made: Any,
    live: LiveCache | None = None,
) -> None:
    """Point the trainer's train dataloader at the cache, and its training loss at stage 2."""
    trainer.get_train_dataloader = types.MethodType(
        partial(_cached_train_dataloader, rows=rows), trainer
    )
    originals = _originals(trainer)  # a second split_trainer wraps the trainer's own methods
    unsplit = originals["compute_loss"]

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
    trainer.remove_callback(_LiveCacheSteps)
    if live is not None:
        assert isinstance(rows, _LiveRows)
        trainer.add_callback(_LiveCacheSteps(rows))
    train = originals["train"]

    def train_checked(resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            _check_record(trainer, resume_from_checkpoint, record)
        return train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    trainer.train = train_checked


def _originals(trainer: Any) -> dict[str, Any]:
    """The trainer's own ``compute_loss`` and ``train``, as they were before any split."""
    return trainer.__dict__.setdefault(
        "_graphsplit_originals", {"compute_loss": trainer.compute_loss, "train": trainer.train}
    )


def _cached_train_dataloader(trainer: Any, *, rows: Dataset) -> DataLoader:
    """``Trainer.get_train_dataloader`` over the cache: the trainer's sampler, built from the
    raw dataset (the same order and length groups as the unsplit run), picks the rows (or,
    while a live cache is written, the raw items)."""
    args = trainer.args
    raw, collator = _dataset_and_collator(trainer, "Training")
    sampler = trainer._get_train_sampler(raw)
    if isinstance(rows, _LiveRows):
        rows.raw = raw
    loader = DataLoader(
        rows,
        batch_size=trainer._train_batch_size,
        sampler=sampler,
        collate_fn=_Collate(collator),
        drop_last=args.dataloader_drop_last,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
        worker_init_fn=partial(
            _seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        ),
    )
    return trainer.accelerator.prepare(loader)


def _seed_worker(worker_id: int, num_workers: int, rank: int) -> None:
    from transformers.trainer_utils import seed_worker

    seed_worker(worker_id, num_workers=num_workers, rank=rank)


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


class _LiveCacheSteps(_checkpoint_callback_base()):
    """Drives a live cache from the trainer's events: a checkpoint commits the rows computed
    so far; the end of an epoch not cut short finishes the cache (every process; later epochs
    read it); the end of training before that commits and closes (a resumed run continues)."""

    def __init__(self, rows: _LiveRows) -> None:
        self.rows = rows

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rows.live.commit()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The trainer sets state.epoch to epoch + (step + 1) / steps_in_epoch at every step: a
        # whole number at an epoch's last batch, a fraction where max_steps or a callback cut
        # it short (the cache then stays open for a resume).
        live = self.rows.live
        whole = state.epoch is not None and float(state.epoch).is_integer()
        if self.rows.cached is None and whole:
            live.finish()
            _refuse_several_shapes(live.dataset())
            self.rows.switch()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.rows.live.complete:
            self.rows.live.commit()
            self.rows.live.close()


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
