"""The per-sample probe at the batch's own size (``graphsplit/calls/reordered.py``).

Each step here builds a tensor for its training batch size (as diffusers' LCM script builds
``uncond_prompt_embeds`` for ``args.train_batch_size``) and combines it with the batch, so it
raises on one sample alone; the module path then shows its calls per sample by running the
batch reversed and each end sample repeated, at the batch's own size. A frozen call that mixes
samples or reads a sample's position must be refused, one that works row by row cached, and
the split exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.calls import Verdict
from graphsplit.calls.reordered import take, variants

WIDTH = 4


class Encoder(nn.Module):
    """A frozen encoder whose ``kind`` says how its rows depend on the batch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.kind = kind
        if kind == "batch_norm_train":  # batch statistics, no running ones: nothing mutated
            self.norm = nn.BatchNorm1d(WIDTH, affine=False, track_running_stats=False)

    def forward(self, x):
        h = self.linear(x)
        if self.kind == "batch_mean":
            return h - h.mean(dim=0, keepdim=True)
        if self.kind == "batch_norm_train":
            return self.norm(h)
        if self.kind == "batch_max":
            return h / h.abs().max()
        if self.kind == "position":
            return h + torch.arange(h.shape[0], dtype=h.dtype)[:, None]
        if self.kind == "flip":
            return h.flip(0)
        if self.kind == "roll":
            return h.roll(1, dims=0)
        if self.kind == "row_norm":  # per sample: each row by its own norm
            return h / h.norm(dim=1, keepdim=True)
        return torch.tanh(h)


PER_SAMPLE = ("plain", "row_norm")
MIXING = ("batch_mean", "batch_norm_train", "batch_max", "position", "flip", "roll")


class SizeBoundStep(nn.Module):
    """Builds its unconditional rows for ``train_batch_size`` and stacks them with the batch's:
    it runs at that size only."""

    def __init__(self, kind: str, train_batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder(kind)
        self.head = nn.Linear(WIDTH, 1)
        self.register_buffer("uncond", torch.zeros(train_batch_size, WIDTH))

    def forward(self, x):
        h = self.encoder(x)
        both = torch.stack([h, self.uncond + x.mean()])  # raises at another batch size
        return self.head(both).square().mean()


def _refusal(step: nn.Module, x: torch.Tensor) -> str:
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (x,), path="calls")
    return str(caught.value)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(PER_SAMPLE + MIXING),
    size=st.integers(2, 4),
    seed=st.integers(0, 2**16),
)
def test_at_its_own_size_the_probe_refuses_every_mixing_call_and_caches_per_sample_ones(
    kind, size, seed
):
    step = SizeBoundStep(kind, size)
    x = torch.randn(size, WIDTH, generator=torch.Generator().manual_seed(seed))
    with pytest.raises((RuntimeError, ValueError)):  # the step cannot run one sample alone
        step(x[-1:])
    if kind in MIXING:
        message = _refusal(step, x)
        assert f"encoder call 0: {Verdict.MIXES_SAMPLES.why} (out: its rows do not follow" in (
            message
        )
        return
    split = graphsplit.split(step, (x,), path="calls")
    assert [v.verdict for v in split.plan.verdicts] == [Verdict.CACHED]
    assert "encoder.linear.weight" not in dict(split.stage2.named_parameters())
    assert all(c.ok for c in graphsplit.verify(step, split, (x,), seed=seed))


@settings(max_examples=20, deadline=None)
@given(size=st.integers(1, 5), data=st.data())
def test_take_gives_each_row_the_example_row_it_names(size, data):
    rows = tuple(data.draw(st.lists(st.integers(0, size - 1), min_size=size, max_size=size)))
    x = torch.arange(size * 2).reshape(size, 2)
    captions = [f"caption {i}" for i in range(size)]
    value = {"pair": (x, captions), "flags": [i % 2 == 0 for i in range(size)], "scale": 0.5}
    cut = take(value, size, rows)
    assert torch.equal(cut["pair"][0], x[list(rows)])
    assert cut["pair"][1] == [captions[row] for row in rows]
    assert cut["flags"] == [row % 2 == 0 for row in rows]
    assert cut["scale"] == 0.5
    assert [variant.rows for variant in variants(size)] == [
        tuple(range(size - 1, -1, -1)),
        (size - 1,) * size,
        (0,) * size,
    ]


def test_a_call_reading_the_sample_position_is_named_with_the_reversed_batch():
    message = _refusal(SizeBoundStep("position", 3), torch.randn(3, WIDTH))
    assert (
        f"encoder call 0: {Verdict.MIXES_SAMPLES.why} (out: its rows do not follow their "
        "samples when the batch is reversed (rows [2, 1, 0] of the example))"
    ) in message


def test_a_call_that_flips_the_batch_is_named_with_the_last_sample_repeated():
    message = _refusal(SizeBoundStep("flip", 2), torch.randn(2, WIDTH))
    assert (
        "(out: its rows do not follow their samples when the batch is its last sample "
        "repeated (rows [1, 1] of the example))"
    ) in message


class CalledForSomeOrders(SizeBoundStep):
    """Calls the encoder only when the first sample's first value is the larger."""

    def forward(self, x):
        h = self.encoder(x) if x[0, 0] > x[-1, 0] else x
        return self.head(torch.stack([h, self.uncond])).square().mean()


def test_a_call_the_reordered_batch_does_not_make_is_refused():
    x = torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 1]])
    message = _refusal(CalledForSomeOrders("plain", 2), x)
    assert (
        f"encoder call 0: {Verdict.MIXES_SAMPLES.why} (the call is not made when the batch "
        "is reversed)"
    ) in message


class PerSampleLoop(SizeBoundStep):
    """A per-sample loop's calls: each on one unbatched row, so none may be stored once."""

    def forward(self, x):
        h = torch.stack([self.encoder(row) for row in x])
        return self.head(torch.stack([h, self.uncond])).square().mean()


def test_a_per_sample_loops_call_is_refused_at_the_batch_size():
    message = _refusal(PerSampleLoop("plain", 2), torch.randn(2, WIDTH))
    assert (
        f"encoder call 0: {Verdict.NOT_PER_SAMPLE.why} (an unbatched input changes with the "
        "sample (a per-sample call): it differs when the batch is reversed)"
    ) in message


def test_a_batch_of_alike_samples_shows_nothing_and_is_refused():
    message = _refusal(SizeBoundStep("plain", 2), torch.ones(2, WIDTH))
    assert (
        f"encoder call 0: {Verdict.MIXES_SAMPLES.why} (the step cannot run one sample alone "
        "and the example batch's samples are all alike, so reordering them shows nothing: "
        "split with distinct samples)"
    ) in message


class NeedsSortedSamples(SizeBoundStep):
    def forward(self, x):
        if not bool((x[:, 0].diff() > 0).all()):
            raise ValueError("the batch must be sorted")
        return super().forward(x)


def test_a_step_that_fails_on_its_samples_reordered_names_both_errors():
    x = torch.tensor([[0.0, 1, 2, 3], [1.0, 0, 0, 1]])
    message = _refusal(NeedsSortedSamples("plain", 2), x)
    assert f"encoder call 0: {Verdict.MIXES_SAMPLES.why} (the step raised RuntimeError: " in (
        message
    )
    assert (
        "on the last sample alone, and ValueError: the batch must be sorted on the example's "
        "samples reordered at its own size, so nothing shows the call is per sample)"
    ) in message


def test_where_one_sample_runs_alone_the_probe_at_batch_one_is_kept():
    """A step that runs on one sample keeps the probe that runs it alone: a batch mean in the
    step (not in the call) is stage 2's work and the call is cached."""

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder("plain")
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x):
            h = self.encoder(x)
            return self.head(h - h.mean(0)).sum()

    step = Plain()
    x = torch.randn(3, WIDTH)
    split = graphsplit.split(step, (x,), path="calls")
    assert [v.verdict for v in split.plan.verdicts] == [Verdict.CACHED]
    assert all(c.ok for c in graphsplit.verify(step, split, (x,)))
