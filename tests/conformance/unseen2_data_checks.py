"""Checks the unseen-data conformance tests repeat: a loader cached, read back, trained from.

A user's loader (a Hugging Face ``datasets.Dataset`` with a transform, an ``IterableDataset``,
worker processes, a bucket sampler, batches with fields the step ignores) goes through
``graphsplit.cache`` as it is. Read back with ``CachedDataset``, the cache must hold every
sample the loader yielded exactly once, in the loader's order, and stage 2 on each raw batch's
cached rows must train exactly as the unsplit step on that raw batch: the loss and every
trainable gradient bit for bit, under the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphsplit
from tests.conformance.unseen_checks import loss_and_grads


def assert_same_step(
    expected: Callable[[], torch.Tensor],
    actual: Callable[[], torch.Tensor],
    params: Sequence[nn.Parameter],
    seed: int,
) -> None:
    """``actual`` gives ``expected``'s loss and every gradient bit for bit under ``seed``."""
    want_loss, want = loss_and_grads(expected, params, seed)
    got_loss, got = loss_and_grads(actual, params, seed)
    assert torch.equal(want_loss, got_loss), (want_loss, got_loss)
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"gradient {index} differs"


def batch_size_of(batch: Any) -> int:
    """How many samples a raw batch holds: its ``key`` list, else its first tensor's rows."""
    if "key" in batch:
        return len(batch["key"])
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def assert_cache_round_trip(
    split: Any,
    step: Callable[[Any], torch.Tensor],
    loader: Iterable[Any],
    folder: Path,
    params: Sequence[nn.Parameter],
    *,
    expected_keys: Sequence[str] | None = None,
) -> graphsplit.CachedDataset:
    """Cache ``loader``, then check every sample once and in order, and every batch's step.

    ``expected_keys`` are the keys the cache must hold in order (default: the raw batches'
    ``key`` lists, else the positions ``"0"``, ``"1"``...). Returns the cached dataset.
    """
    raw_batches = list(loader)
    sizes = [batch_size_of(batch) for batch in raw_batches]
    info = graphsplit.cache(split, loader, folder, progress=False)
    cached = graphsplit.CachedDataset(folder, split)
    if expected_keys is None:
        if all("key" in batch for batch in raw_batches):
            expected_keys = [str(key) for batch in raw_batches for key in batch["key"]]
        else:
            expected_keys = [str(position) for position in range(sum(sizes))]
    keys = [cached[row]["key"] for row in range(len(cached))]
    assert info.num_samples == len(cached) == sum(sizes)
    assert keys == list(expected_keys)
    assert len(set(keys)) == len(keys)
    row = 0
    for seed, (raw, size) in enumerate(zip(raw_batches, sizes, strict=True)):
        rows = [cached[row + offset] for offset in range(size)]
        row += size
        assert_same_step(
            lambda raw=raw: step(raw),
            lambda rows=rows: split.stage2(**graphsplit.collate(rows)),
            params,
            seed,
        )
    assert row == len(cached)
    return cached


def assert_epoch_covers_each_sample_once(
    cached: graphsplit.CachedDataset, loader: Any, epoch: int
) -> list[list[str]]:
    """The keys of each batch of ``loader``'s ``epoch``: every cached sample exactly once."""
    loader.set_epoch(epoch)
    batches = loader.batch_sampler.epoch_batches(epoch)
    keys = [[cached[index]["key"] for index in batch] for batch in batches]
    flat = [key for batch in keys for key in batch]
    assert sorted(flat) == sorted(cached[row]["key"] for row in range(len(cached)))
    assert len(set(flat)) == len(flat)
    return keys


def kd_teacher_and_lora_student() -> tuple[nn.Module, nn.Module]:
    """A tiny frozen Llama teacher and a Llama student with LoRA on ``q_proj`` / ``v_proj``
    (seed 0), its ``lora_B`` drawn small: peft's zeros would leave ``lora_A`` without a
    gradient, and the exactness checks compare every trainable gradient."""
    import peft
    import transformers

    from tests.helpers import tiny_llama_config

    torch.manual_seed(0)
    teacher = transformers.LlamaForCausalLM(tiny_llama_config(pad_token_id=0))
    teacher.eval().requires_grad_(False)
    base = transformers.LlamaForCausalLM(tiny_llama_config(pad_token_id=0))
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"
    )
    student = peft.get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(5)
    for name, param in student.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    return teacher, student
