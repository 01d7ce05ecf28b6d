"""Checks the unseen15 many-shapes dataset tests repeat: a whole loader cached, an epoch trained.

A real data pipeline (the upstream collator, batches of many padded lengths or frame counts,
a last batch shorter than the others) goes through ``graphsplit.cache`` as it is. Then:

- every cached sample is checked against stage 1 run again on its raw batch (row by row,
  each boundary tensor bit for bit): ``wrong_samples`` counts the samples that differ;
- stage 2 on each raw batch's cached rows (in the order they were written) trains exactly as
  the unsplit step on the raw batch (loss and every trainable gradient bit for bit);
- an epoch of ``cached.loader(batch_size, seed=0)`` (batches of one shape, shuffled), each
  batch against the unsplit step on the same samples, which the test builds from their keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_same_step, batch_size_of


@dataclass
class CacheRun:
    cached: graphsplit.CachedDataset
    raw_batches: list[Any]
    plans: int
    wrong_samples: list[str]


def _fields(batch: Any) -> dict[str, Any]:
    return dict(batch) if not isinstance(batch, dict) else batch


def cache_whole_loader(
    split: Any,
    step: Callable[[Any], torch.Tensor],
    loader: Any,
    folder: Path,
    params: Sequence[torch.nn.Parameter],
    *,
    as_iterable: bool = False,
    wrap: Callable[[Callable[[], torch.Tensor]], torch.Tensor] = lambda run: run(),
) -> CacheRun:
    """Cache ``loader``; check every sample against stage 1 and every written batch's step.
    ``wrap(run)`` runs each side's step (to seed another generator from torch's seed);
    ``as_iterable`` passes the loader's batches as a generator (rows numbered as they come)."""
    raw_batches = list(loader)
    source = (batch for batch in raw_batches) if as_iterable else loader
    info = graphsplit.cache(split, source, folder, progress=False)
    cached = graphsplit.CachedDataset(folder, split)
    sizes = [batch_size_of(batch) for batch in raw_batches]
    assert info.num_samples == len(cached) == sum(sizes)
    keys = [cached[row]["key"] for row in range(len(cached))]
    assert len(set(keys)) == len(keys)
    wrong: list[str] = []
    row = 0
    for seed, (raw, size) in enumerate(zip(raw_batches, sizes, strict=True)):
        items = [cached[row + offset] for offset in range(size)]
        out = split.stage1(**_fields(raw))
        for offset, item in enumerate(items):
            one = graphsplit.collate([item])
            for name, dim, _dtype in item.collation.rows:
                want = out[name].narrow(dim, offset, 1)
                if not torch.equal(one[name].to(want.dtype), want):
                    wrong.append(f"{item['key']}:{name}")
        assert_same_step(
            lambda raw=raw: wrap(lambda: step(raw)),
            lambda items=items: wrap(lambda: split.stage2(**graphsplit.collate(items))),
            params,
            seed,
        )
        row += size
    assert row == len(cached)
    return CacheRun(cached, raw_batches, len(split.plans), wrong)


def train_epoch_from_cache(
    split: Any,
    step: Callable[[Any], torch.Tensor],
    cached: graphsplit.CachedDataset,
    eager_batch: Callable[[list[str]], Any],
    params: Sequence[torch.nn.Parameter],
    *,
    batch_size: int,
    shuffle: bool = True,
    wrap: Callable[[Callable[[], torch.Tensor]], torch.Tensor] = lambda run: run(),
) -> list[list[str]]:
    """An epoch of ``cached.loader(batch_size, shuffle=shuffle, seed=0)``: each batch's stage 2
    against the
    step on ``eager_batch(keys)`` (the same samples, in the loader's order). Returns the keys
    of each batch; every cached sample is trained exactly once."""
    loader = cached.loader(batch_size=batch_size, shuffle=shuffle, seed=0)
    loader.set_epoch(0)
    indices = loader.batch_sampler.epoch_batches(0)
    seen: list[list[str]] = []
    for seed, (batch, rows) in enumerate(zip(loader, indices, strict=True)):
        keys = [str(cached[index]["key"]) for index in rows]
        raw = eager_batch(keys)
        assert_same_step(
            lambda raw=raw: wrap(lambda: step(raw)),
            lambda batch=batch: wrap(lambda: split.stage2(**batch)),
            params,
            seed,
        )
        seen.append(keys)
    flat = [key for keys in seen for key in keys]
    assert sorted(flat) == sorted(str(cached[row]["key"]) for row in range(len(cached)))
    return seen
