"""A value read off frozen data at several samples per batch (``mask.sum(dim=1).tolist()`` over
a batch bucketed by prompt length): one plan per value, each sample reading it; one split, one
cache over buckets of two lengths, stage 2 bit-equal to the unsplit step. A batch whose samples
read different values, a value that mixes the batch, and a stage-2 batch of another size than
the plan's are refused, each message checked."""

from __future__ import annotations

import pytest
import torch

import graphsplit
from graphsplit.errors import SplitError, TensorValueError
from tests.helpers import line_of
from tests.planning.test_value_reads import (
    TOKENS,
    VOCAB,
    ReadsPromptLengths,
    model_fn,
    prompt,
)
from tests.signatures.epoch import epoch_exact


def lengths_fn(head: torch.nn.Module, states, mask, target):
    """DiffSynth's pattern without a frozen table sliced by the value (that per-plan constant
    is tests/signatures/test_plan_constants.py's)."""
    lengths = mask.sum(dim=1).tolist()
    longest = max(lengths)
    scores = head(states).squeeze(-1)[:, :longest]
    return torch.nn.functional.mse_loss(scores, target)


class ReadsLengths(ReadsPromptLengths):
    def forward(self, ids, mask, target):
        return lengths_fn(self.head, self.embed(ids), mask, target)


def test_buckets_of_two_prompt_lengths_train_exactly_from_one_cache(tmp_path):
    step = ReadsLengths()
    split = graphsplit.split(step, kwargs=prompt(4, size=2), path="trace")
    batches = [prompt(length, seed=seed, size=2) for seed, length in enumerate((4, 3, 4), 1)]
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=2)
    values = sorted(str(signature).rsplit("= ", 1)[-1] for signature in split.signatures)
    assert values == ["[3, 3]", "[4, 4]"]
    assert len(result.batches) == 3


def _mixed_lengths(lengths: list[int]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    mask = torch.zeros(len(lengths), TOKENS, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return {
        "ids": torch.randint(0, VOCAB, (len(lengths), TOKENS), generator=generator),
        "mask": mask,
        "target": torch.randn(len(lengths), max(lengths), generator=generator),
    }


def test_an_example_whose_samples_read_different_values_is_refused_naming_the_line():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(ReadsPromptLengths(), kwargs=_mixed_lengths([4, 3]), path="trace")
    message = str(caught.value)
    assert line_of(model_fn, ".tolist()") in message  # the refusal as before answering
    note = "\n".join(caught.value.__notes__)
    assert "does not read one value per sample that every sample shares" in note
    assert "fix:    bucket the loader by this value" in note


def test_a_cached_batch_whose_samples_read_different_values_is_refused(tmp_path):
    split = graphsplit.split(ReadsPromptLengths(), kwargs=prompt(4, size=2), path="trace")
    loader = [prompt(4, seed=1, size=2), _mixed_lengths([4, 3])]
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    assert "every sample shares" in "\n".join(caught.value.__notes__)


def total_fn(head: torch.nn.Module, states, mask, target):
    """A per-sample-shaped value that is the whole batch's: the same at [4, 4] and [3, 5]."""
    lengths = (mask.sum(dim=1) * 0 + mask.sum()).tolist()
    scores = head(states).squeeze(-1)
    return torch.nn.functional.mse_loss(scores.sum(-1) * lengths[0], target.sum(-1))


class ReadsTheBatchTotal(ReadsPromptLengths):
    def forward(self, ids, mask, target):
        return total_fn(self.head, self.embed(ids), mask, target)


def test_a_value_that_mixes_the_batch_is_refused():
    with pytest.raises(TensorValueError) as caught:
        graphsplit.split(ReadsTheBatchTotal(), kwargs=prompt(4, size=2), path="trace")
    message = str(caught.value)
    assert "must be computed every step (mixing: mixes samples of th" in message
    assert line_of(total_fn, ".tolist()") in message
    assert "fix:" in message


def test_a_stage2_batch_of_another_size_than_the_plans_is_refused(tmp_path):
    split = graphsplit.split(ReadsPromptLengths(), kwargs=prompt(4, size=2), path="trace")
    outputs = split.stage1(**prompt(4, seed=1, size=2))
    one = {k: v[:1] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in outputs.items()}
    with pytest.raises(SplitError) as caught:
        split.stage2(**one)
    message = str(caught.value)
    assert "stage 2 got 1 samples in" in message
    assert "holds a value read off frozen data for a batch of 2 samples" in message
    assert "loader(batch_size=2, drop_last=True)" in message
