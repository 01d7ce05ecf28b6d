"""Checks the second round of unseen-diffusers steps share: train stage 2 from a stale cache.

``assert_trains_from_its_cache`` caches the script's batches through the disk under one seed,
then takes an optimizer-like step on every trainable parameter and checks stage 2, fed the
*old* cache, against the unsplit step with the *new* weights and a new seed, loss and every
gradient bit for bit. A boundary that depended on a trainable weight (a text encoder whose
token embedding trains) or on a random draw (VAE sampling, noise) would still hold the old
value and fail. The steps are closures over the script's models, called as ``step(batch)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphsplit
from tests.conformance.unseen_checks import loss_and_grads


def _rows(batch: dict[str, Any]) -> int:
    return next(len(value) for value in batch.values() if isinstance(value, torch.Tensor))


def assert_trains_from_its_cache(
    split: Any,
    step: Callable[[Any], torch.Tensor],
    batches: Sequence[dict[str, Any]],
    folder: Path,
    params: Sequence[nn.Parameter],
) -> None:
    """Cache ``batches`` under one seed, move ``params``, train stage 2 from the old cache."""
    assert params and all(param.requires_grad for param in params)
    torch.manual_seed(1234)
    graphsplit.cache(split, list(batches), folder / "cache", progress=False)
    dataset = graphsplit.CachedDataset(folder / "cache", split)
    cached, start = [], 0
    for batch in batches:
        rows = _rows(batch)
        cached.append(graphsplit.collate([dataset[row] for row in range(start, start + rows)]))
        start += rows
    assert len(dataset) == start
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():  # an optimizer step
        for param in params:
            param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.05)
    for index, (raw, boundary) in enumerate(zip(batches, cached, strict=True)):
        seed = 7 + index
        expected, expected_grads = loss_and_grads(lambda raw=raw: step(raw), params, seed)
        actual, grads = loss_and_grads(lambda b=boundary: split.stage2(**b), params, seed)
        assert torch.equal(expected, actual), (expected, actual)
        for want, got in zip(expected_grads, grads, strict=True):
            assert (want is None) == (got is None)
            assert want is None or torch.equal(want, got)


def cached_outputs(split: graphsplit.CallSplit) -> set[str]:
    """The boundary's cached call outputs: neither the step's inputs nor the shape an input
    only cached calls compute with crosses as (``<input>__shape``: :func:`unstored_inputs`)."""
    shapes = {f"{name}__shape" for name in split.plan.unstored}
    return {key for key in split.boundary if key not in split.input_names and key not in shapes}


def unstored_inputs(split: graphsplit.CallSplit) -> set[str]:
    """The inputs whose values are not stored (only cached calls compute with them), checked
    to cross as their shape alone."""
    unstored = set(split.plan.unstored)
    assert {f"{name}__shape" for name in unstored} <= set(split.boundary)
    assert not unstored & set(split.boundary)
    return unstored
