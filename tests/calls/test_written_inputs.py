"""A step that writes a stored input in place before its last cached call (module-level path).

Whisper's SpecAugment masks ``input_features`` in place before the frozen encoder, whose
position embeddings are cached: stage 1 runs the step up to that call, so the batch it stores
had already been masked once, and stage 2 masked it again. The trainer's first loss was off in
the 5th digit, with nothing else wrong. Stage 1 now stores a copy, taken before the run, of an
input the probes saw the step write (``CallPlan.written_inputs``), and refuses a batch whose
step writes one the example's step did not.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.errors import SplitError


class ScalesItsInput(nn.Module):
    """Doubles ``weights`` in place (not idempotent: twice is not once) before a frozen
    encoder of ``x`` is called; ``weights`` crosses to stage 2."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.scale_inputs = True

    def forward(self, x, weights):
        if self.scale_inputs:
            weights.mul_(2.0)
        hidden = self.encoder(x)
        return (self.head(hidden).squeeze(-1) * weights).mean()


def _batches(seed: int, size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(size, 4, generator=generator),
        "weights": torch.rand(size, generator=generator) + 0.5,
    }


def _eager(step: nn.Module, raw: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    step.zero_grad()
    loss = step(**{key: value.clone() for key, value in raw.items()})
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in step.head.parameters()]


def test_the_cache_stores_the_input_as_the_batch_gave_it(tmp_path):
    torch.manual_seed(0)
    step = ScalesItsInput()
    example = _batches(0, 3)
    split = graphsplit.split(step, kwargs=_copy(example), path="calls")
    assert split.plan.written_inputs == frozenset({"weights"})
    raw = [_batches(seed, size) for seed, size in ((1, 2), (2, 3))]
    graphsplit.cache(split, [_copy(b) for b in raw], tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    row = 0
    for given in raw:
        size = given["x"].shape[0]
        rows = [cached[row + offset] for offset in range(size)]
        row += size
        stored = torch.stack([r["weights"] for r in rows])
        assert torch.equal(stored, given["weights"])  # not doubled by stage 1
        want_loss, want_grads = _eager(step, given)
        step.zero_grad()
        loss = split.stage2(**graphsplit.collate(rows))
        loss.backward()
        assert torch.equal(loss.detach(), want_loss)
        for param, want in zip(step.head.parameters(), want_grads, strict=True):
            assert torch.equal(param.grad, want)


def test_a_write_the_example_did_not_make_is_refused(tmp_path):
    torch.manual_seed(0)
    step = ScalesItsInput()
    step.scale_inputs = False
    split = graphsplit.split(step, kwargs=_copy(_batches(0, 3)), path="calls")
    assert split.plan.written_inputs == frozenset()
    step.scale_inputs = True  # e.g. augmentation switched on after splitting
    with pytest.raises(SplitError) as caught:
        graphsplit.cache(split, [_batches(1, 2)], tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "wrote the stored input(s) ['weights'] in place on this batch" in message
    assert "did not on the example batch" in message
    assert "fix:" in message and "x = x.clone()" in message


def _copy(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in values.items()}
