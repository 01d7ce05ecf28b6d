"""TRL DPO's reference log-probs from a graphsplit cache, in place of ``precompute_ref_log_probs``.

DPO's loss compares the policy's log-probs of the chosen and rejected completions with a frozen
reference model's. Those reference log-probs never change for a sample: TRL's own
``precompute_ref_log_probs=True`` computes them once into an Arrow file beside the dataset.
:func:`cache_reference_log_probs` computes them with TRL's own code
(``DPOTrainer.compute_ref_log_probs``, its fused log-prob head and autocast included) through
graphsplit: stage 1 is that computation for one preference pair, cached as safetensors rows
(fingerprinted by the reference weights and code, resumable, written in shares under
``accelerate launch``), and the trainer then trains exactly as TRL's precomputed run does,
reading the values from its dataset.

Glossary:
    pair: one dataset item, its chosen and rejected sequences; TRL's collator stacks a batch as
        ``[chosen rows; rejected rows]``, so a pair is collated alone (two rows, padded to the
        longer) and given a leading dim of 1: the step is planned one sample per batch.
    reference step (:class:`ReferenceLogProbs`): ``compute_ref_log_probs`` on one pair, returning
        ``[[chosen, rejected]]``; every parameter is frozen, so stage 1 is all of it and each
        cache sample is the pair's two log-probs (8 bytes).

Exact: each pair's values are TRL's ``compute_ref_log_probs`` on that pair alone, which is what
TRL computes with ``precompute_ref_batch_size=1``; TRL at a bigger batch pads pairs to the
batch's longest and runs other matmul shapes, which changes the last bits (see
docs/comparison.md).

In and out::

    reference = cache_reference_log_probs(trainer, "ref-cache/")   # -> ReferenceCache
    trainer.train()      # TRL's loss, its reference log-probs read from the dataset
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from graphsplit.api import Split, split
from graphsplit.caching import CachedDataset, CacheInfo, cache
from graphsplit.integrations.trl_checks import check_reference_trainer
from graphsplit.planning.rules.random_draws import generator_states, set_generator_states

__all__ = ["ReferenceCache", "ReferenceLogProbs", "cache_reference_log_probs"]

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


class ReferenceLogProbs(nn.Module):
    """``trainer.compute_ref_log_probs`` on one pair: fields ``[1, 2, length]`` -> ``[1, 2]``."""

    def __init__(self, trainer: Any) -> None:
        super().__init__()
        # A PEFT policy without a ref_model: TRL's compute_ref_log_probs runs the policy with
        # its adapter switched off (use_adapter(model, None)), the base is the reference.
        self.ref_model = trainer.ref_model if trainer.ref_model is not None else trainer.model
        object.__setattr__(self, "_compute", trainer.compute_ref_log_probs)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
    ) -> torch.Tensor:
        if input_ids.shape[0] != 1:  # also what makes graphsplit plan one pair per batch
            raise ValueError(f"one preference pair per call, not {input_ids.shape[0]}")
        pair = {
            "input_ids": input_ids[0],
            "attention_mask": attention_mask[0],
            "completion_mask": completion_mask[0],
        }
        chosen, rejected = self._compute(self.ref_model, pair)
        return torch.stack([chosen, rejected], dim=1)


@dataclass(frozen=True)
class ReferenceCache:
    """What :func:`cache_reference_log_probs` made: the split and, per dataset, its cache."""

    split: Split
    cached: dict[str, CachedDataset]
    info: dict[str, CacheInfo | None]


def cache_reference_log_probs(
    trainer: Any,
    cache_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool | None = False,
) -> ReferenceCache:
    """Cache a ``trl.DPOTrainer``'s reference log-probs and train from them.

    Computes the reference model's log-probs of every pair of the train dataset (and of the
    eval dataset, if the trainer has one) with ``trainer.compute_ref_log_probs``, stores them
    in a graphsplit cache under ``cache_dir/train`` (``cache_dir/eval``), adds them to the
    datasets as TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns and switches the
    trainer to reading them, as ``precompute_ref_log_probs=True`` does. Run again with the same
    reference weights and data it reuses the cache; with other weights it refuses
    (``StaleCacheError``) unless ``overwrite=True``.

    Args:
        trainer: a ``trl.DPOTrainer`` built with ``precompute_ref_log_probs=False``, with a
            ``ref_model`` or a PEFT policy without one (TRL's LoRA-DPO: the reference is the
            base with the adapter switched off, which TRL's own code does).
        cache_dir: the folder (or fsspec URL) for the caches.
        overwrite: replace caches made from other weights, code or data.
        progress: show the caching progress bar.

    Returns:
        :class:`ReferenceCache`.

    Raises:
        SplitError: the trainer is not a ``DPOTrainer`` (a ``KTOTrainer``'s reference
            log-probs include its KL pairs': ``KTOConfig(precompute_ref_log_probs=True)``),
            already precomputes, has neither a ``ref_model`` nor a PEFT policy, has a vision
            dataset, or updates its reference model during training (``sync_ref_model=True``).
    """
    check_reference_trainer(trainer)
    states = generator_states()  # the trainer's seeded generators, as the unsplit run has them
    try:
        reference = ReferenceLogProbs(trainer)
        pairs = {"train": trainer.train_dataset}
        if trainer.eval_dataset is not None:
            pairs["eval"] = trainer.eval_dataset
        with trainer.accelerator.autocast():  # TRL switches it on inside; trace under it too
            example = next(iter(_pair_loader(trainer, pairs["train"])))
            parts = split(reference, (), example, frozen=lambda name, parameter: True)
            infos, cached = {}, {}
            for name, dataset in pairs.items():
                path = f"{os.fspath(cache_dir).rstrip('/')}/{name}"
                infos[name] = cache(
                    parts,
                    _pair_loader(trainer, dataset),
                    path,
                    accelerator=trainer.accelerator
                    if trainer.accelerator.num_processes > 1
                    else None,
                    overwrite=overwrite,
                    progress=progress,
                )
                trainer.accelerator.wait_for_everyone()
                cached[name] = CachedDataset(path, parts)
    finally:
        set_generator_states(states)
    (output,) = parts.boundary
    trainer.train_dataset = with_reference_columns(pairs["train"], cached["train"], output)
    if "eval" in cached:
        trainer.eval_dataset = with_reference_columns(pairs["eval"], cached["eval"], output)
    trainer.precompute_ref_logps = True
    return ReferenceCache(split=parts, cached=cached, info=infos)


def with_reference_columns(dataset: Any, cached: CachedDataset, output: str) -> Any:
    """``dataset`` with TRL's two reference columns, read from the cache's rows in order."""
    rows = torch.stack([cached[index][output] for index in range(len(cached))])
    chosen, rejected = rows[:, 0].tolist(), rows[:, 1].tolist()
    dataset = dataset.remove_columns([c for c in COLUMNS if c in dataset.column_names])
    return dataset.add_column(COLUMNS[0], chosen).add_column(COLUMNS[1], rejected)


def _pair_loader(trainer: Any, dataset: Any) -> DataLoader:
    """One pair a batch, through TRL's collator, each field given a leading dim of 1."""
    collator = trainer.data_collator

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = collator(items)
        return {key: batch[key].unsqueeze(0) for key in _FIELDS}

    return DataLoader(dataset, batch_size=1, shuffle=False, collate_fn=collate)


_FIELDS = ("input_ids", "attention_mask", "completion_mask")
