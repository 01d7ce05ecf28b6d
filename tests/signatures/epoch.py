"""One split(), one cache() over a loader of mixed shapes, one epoch of stage 2 against the
unsplit step: the check every real-class test of :mod:`tests.signatures` makes.

The loader's batches (each a dict of tensors batched along dim 0, as a ``DataLoader`` hands them
over, padded or bucketed as the user's collate made them) go to :func:`graphsplit.cache` as they
are, each row named by a key. Stage 2 reads the cache through ``CachedDataset.loader`` (the
seeded bucket sampler and :func:`graphsplit.collate`: no bucket loop here), with a collate that
also hands over the batch's keys, so the unsplit step runs on exactly the raw rows the batch
holds, stacked in its order. Both run under the same torch seed; losses and every trainable
gradient are compared with ``torch.equal``.

In and out::

    keyed(batches) -> loader batches with "key"   (keys "i-row")
    epoch_exact(step, split, batches, path, batch_size=2) -> EpochResult
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import graphsplit

__all__ = ["EpochResult", "epoch_exact", "keyed"]


@dataclass
class EpochResult:
    """What one epoch of stage 2 saw: each batch's keys and tensor shapes, the plans made."""

    batches: list[list[str]]
    shapes: list[dict[str, tuple[int, ...]]]
    cached: graphsplit.CachedDataset


def keyed(batches: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batches with a ``"key"`` list naming each row ``"<batch>-<row>"``."""
    out = []
    for i, batch in enumerate(batches):
        rows = _rows(batch)
        out.append({**batch, "key": [f"{i}-{row}" for row in range(rows)]})
    return out


def _rows(batch: dict[str, Any]) -> int:
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def _trainable_grads(step: torch.nn.Module) -> list[torch.Tensor | None]:
    return [
        None if p.grad is None else p.grad.clone() for p in step.parameters() if p.requires_grad
    ]


def _run(step: torch.nn.Module, seed: int, compute: Callable[[], torch.Tensor]):
    step.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = compute()
    loss.backward()
    return loss.detach(), _trainable_grads(step)


def epoch_exact(
    step: torch.nn.Module,
    split: graphsplit.Split,
    batches: Sequence[dict[str, Any]],
    path: Path,
    *,
    batch_size: int = 2,
    unsplit: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> EpochResult:
    """Cache ``batches`` with ``split`` and train one epoch from the cache, each batch's loss and
    trainable gradients bit-equal to ``unsplit`` (``step(**raw)``) on the batch's raw rows."""
    loader = keyed(batches)
    raw = {
        key: {name: value[row : row + 1] for name, value in batch.items() if name != "key"}
        for batch in loader
        for row, key in enumerate(batch["key"])
    }
    graphsplit.cache(split, loader, path, progress=False)
    cached = graphsplit.CachedDataset(path, split)
    stage2_loader = cached.loader(
        batch_size=batch_size,
        seed=0,
        collate_fn=lambda items: (graphsplit.collate(items), [item["key"] for item in items]),
    )
    unsplit = unsplit or (lambda inputs: step(**inputs))
    seen: list[list[str]] = []
    shapes: list[dict[str, tuple[int, ...]]] = []
    for number, (batch, keys) in enumerate(stage2_loader):
        inputs = {name: torch.cat([raw[key][name] for key in keys]) for name in raw[keys[0]]}
        got = _run(step, number, lambda batch=batch: split.stage2(**batch))
        expected = _run(step, number, lambda inputs=inputs: unsplit(inputs))
        assert torch.equal(got[0], expected[0]), (keys, got[0], expected[0])
        for a, b in zip(got[1], expected[1], strict=True):
            assert (a is None and b is None) or torch.equal(a, b), keys
        seen.append(keys)
        shapes.append({name: tuple(v.shape) for name, v in inputs.items()})
    step.zero_grad(set_to_none=True)
    assert sorted(key for keys in seen for key in keys) == sorted(raw)  # every sample once
    return EpochResult(seen, shapes, cached)
