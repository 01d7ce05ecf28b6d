"""Checks the unseen14 sized-constant conformance tests repeat: one split, many padded lengths.

A causal (or seq2seq) LM with a PEFT LoRA, trained with the Trainer's ``compute_loss`` body
``model(**inputs).loss`` on batches a collator pads to their longest row. For each padded
length: ``graphsplit.verify`` exact (the loss and every LoRA gradient bit for bit); then the
batches of every length cached through disk, read back, and stage 2 on ``cached.loader``
batches (rows of one shape, shuffled with a seed) exact against the eager step on the same
samples. The number of plans after stage 1 saw every length is returned for the test to pin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip, assert_same_step

Batch = dict[str, Any]


def lm_batch(collator: Any, length: int, size: int = 3, *, vocab: int, seed: int = 0) -> Batch:
    """``size`` rows of random ids (3..vocab), the longest ``length`` tokens, the others
    shorter, padded to ``length`` by ``collator`` (``DataCollatorWithPadding`` /
    ``DataCollatorForLanguageModeling``)."""
    generator = torch.Generator().manual_seed(1000 * length + seed)
    rows = []
    for index in range(size):
        n = max(2, length - 2 * index)
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        rows.append({"input_ids": ids})
    batch = dict(collator(rows))
    assert batch["input_ids"].shape[1] == length
    return batch


def signatures(split: Any) -> list[str]:
    """Each plan's signature and the lines that read it, for a failure message."""
    return [f"{plan.signature} {plan.signature.lines}" for plan in split.plans]


def check_lengths(
    split: Any,
    step: Callable[[Batch], torch.Tensor],
    batches: Sequence[Batch],
) -> int:
    """``verify`` exact on each batch; the plans made, stage 1 having run on each batch."""
    for seed, batch in enumerate(batches):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    return len(split.plans)


def check_cache_and_loader(
    split: Any,
    step: Callable[[Batch], torch.Tensor],
    batches: Sequence[Batch],
    folder: Path,
    params: Sequence[torch.nn.Parameter],
) -> None:
    """Cache the batches (one padded length each), read them back, then stage 2 on
    ``cached.loader(batch_size=2, seed=0)`` batches against the eager step on their samples."""
    lengths = [batch["input_ids"].shape[1] for batch in batches]
    assert len(set(lengths)) == len(lengths), "one batch per padded length"
    cached = assert_cache_round_trip(split, step, list(batches), folder, params)
    where: dict[str, tuple[int, int]] = {}
    for index, batch in enumerate(batches):
        for row in range(batch["input_ids"].shape[0]):
            where[str(len(where))] = (index, row)
    loader = cached.loader(batch_size=2, seed=0)
    loader.set_epoch(0)
    indices = loader.batch_sampler.epoch_batches(0)
    seen = []
    for seed, (rows, batch_indices) in enumerate(zip(loader, indices, strict=True)):
        keys = [str(cached[index]["key"]) for index in batch_indices]
        (index,) = {where[key][0] for key in keys}  # one shape: one raw batch
        picks = torch.tensor([where[key][1] for key in keys])
        eager = {k: v[picks] for k, v in batches[index].items()}
        assert_same_step(
            lambda eager=eager: step(eager),
            lambda rows=rows: split.stage2(**rows),
            params,
            seed,
        )
        seen.extend(keys)
    assert sorted(seen) == sorted(where)


def lora(model: Any, targets: Sequence[str], task_type: str = "CAUSAL_LM") -> Any:
    """PEFT's documented LoRA edit; ``lora_B`` drawn small so every LoRA gradient flows."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=list(targets),
        task_type=task_type,
        init_lora_weights="gaussian",
    )
    model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.train()
    return model


def run_causal_lm(
    model: Any, collator: Any, lengths: Sequence[int], folder: Path, *, vocab: int
) -> Any:
    """Split ``model(**inputs).loss`` at ``lengths[0]``, verify at every length, cache them all
    and train stage 2 from the cache's loader. Returns the split (the test pins its plans)."""
    from tests.helpers import assert_stage1_holds_no_trainable

    def compute_loss(inputs):
        return model(**inputs).loss

    batches = [lm_batch(collator, length, vocab=vocab) for length in lengths]
    split = graphsplit.split(compute_loss, (batches[0],))
    assert_stage1_holds_no_trainable(split)
    check_lengths(split, compute_loss, batches)
    params = [p for p in model.parameters() if p.requires_grad]
    check_cache_and_loader(split, compute_loss, batches, folder, params)
    return split
