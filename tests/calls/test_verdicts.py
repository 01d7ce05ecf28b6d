"""Each verdict of the module-level path, on a small step built to earn it.

A call is cached only when its exactness is proven; every other verdict keeps the call (and
its module's weights) in stage 2. Each step below would be wrong if its frozen call were
cached: the split stays exact because it is not.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls import Verdict

HIDDEN = 4


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.head = nn.Linear(HIDDEN, 1)
        self.adapter = nn.Linear(HIDDEN, HIDDEN)


class TrainableInput(Frozen):
    def forward(self, x):
        return self.head(self.encoder(self.adapter(x))).sum()


class TrainableUnderNoGrad(Frozen):
    """The adapter's output reaches the encoder under no_grad: no autograd record, yet cached
    it would go stale once the adapter trains."""

    def forward(self, x):
        with torch.no_grad():
            h = self.encoder(self.adapter(x))
        return self.head(h).sum() + self.adapter(x).sum()


class TrainableDetached(Frozen):
    def forward(self, x):
        return self.head(self.encoder(self.adapter(x).detach())).sum() + self.adapter(x).sum()


class ZeroGate(Frozen):
    """A zero-initialised trainable gate (LoRA's ``B``, a ControlNet's zero convolution): the
    encoder's input does not depend on it at all until it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x):
        with torch.no_grad():
            h = self.encoder(x + self.gate * x)
        return self.head(h).sum() + self.gate.sum()


class RandomInput(Frozen):
    def forward(self, x):
        return self.head(self.encoder(x + torch.randn_like(x))).sum()


class NumpyInput(Frozen):
    def forward(self, x):
        shift = float(np.random.rand())
        return self.head(self.encoder(x + shift)).sum()


class PythonRandomInput(Frozen):
    def forward(self, x):
        return self.head(self.encoder(x * random.random())).sum()


class DrawsItself(Frozen):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.5))
        self.encoder.requires_grad_(False)

    def forward(self, x):
        return self.head(self.encoder(x)).sum()


class Mutated(Frozen):
    """The step writes the output in place, and the output is a view of the input (a fresh
    output written in place is cached: tests/calls/test_mutated_output.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Viewing()

    def forward(self, x):
        x = x.clone()
        h = self.encoder(x)
        h.mul_(2)
        return self.head(x).sum()


class Viewing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN), requires_grad=False)

    def forward(self, x):
        return x[:, :]


class MutatesItsInput(Frozen):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = InPlaceEncoder()

    def forward(self, x):
        x = x.clone()
        h = self.encoder(x)
        return self.head(h + x).sum()


class InPlaceEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN), requires_grad=False)

    def forward(self, x):
        x.mul_(self.scale)
        return x + 1


class StringOutput(Frozen):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Describing()

    def forward(self, x):
        h, words = self.encoder(x)
        return self.head(h).sum() + len(words)


class Describing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)

    def forward(self, x):
        return self.linear(x), "a caption"


CASES = [
    (TrainableInput, Verdict.TRAINABLE_INPUT, "trainable parameter"),
    (TrainableUnderNoGrad, Verdict.TRAINABLE_VALUE, "without autograd's record"),
    (TrainableDetached, Verdict.TRAINABLE_VALUE, "without autograd's record"),
    (ZeroGate, Verdict.TRAINABLE_VALUE, "without autograd's record"),
    (RandomInput, Verdict.RANDOM_INPUT, "different seeds"),
    (NumpyInput, Verdict.RANDOM_INPUT, "different seeds"),
    (PythonRandomInput, Verdict.RANDOM_INPUT, "different seeds"),
    (DrawsItself, Verdict.DRAWS_ITSELF, "draws random numbers itself"),
    (Mutated, Verdict.MUTATED, "mutates out in place, and it shares memory"),
    (MutatesItsInput, Verdict.MUTATED, "mutates its inputs"),
    (StringOutput, Verdict.NON_TENSOR, "1 is a str"),
]


@pytest.mark.parametrize(("step_class", "verdict", "words"), CASES)
def test_a_call_that_cannot_be_cached_is_refused_with_its_verdict(step_class, verdict, words):
    step = step_class()
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (torch.randn(3, HIDDEN),), path="calls")
    message = str(caught.value)
    assert "no frozen module call whose inputs are a function of the sample alone" in message
    assert f"encoder call 0: {verdict.why}" in message
    assert words in message
    assert "fix:" in message


class ChecksItsWeights(Frozen):
    """A step that refuses weights it did not expect (a sanity check at its first step)."""

    def forward(self, x):
        if not torch.equal(self.adapter.bias, self.expected):
            raise ValueError("the adapter's bias is not the one it was initialised with")
        return self.head(self.encoder(x)).sum() + self.adapter(x).sum()


def test_a_step_that_fails_with_its_weights_moved_is_refused_naming_the_move():
    step = ChecksItsWeights()
    step.expected = step.adapter.bias.detach().clone()
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (torch.randn(3, HIDDEN),), path="calls")
    message = str(caught.value)
    assert "runs the step with its trainable parameters moved (each trainable" in message
    assert "ValueError: the adapter's bias is not the one it was initialised with" in message
    assert "fix:    let the step run with other trainable weights" in message
    assert torch.equal(step.adapter.bias, step.expected)  # put back


class HalfCached(Frozen):
    """One call of the encoder is cached (fed by the batch), one is not (fed by a draw)."""

    def forward(self, x):
        clean = self.encoder(x)
        noisy = self.encoder(x + torch.randn_like(x))
        return self.head(clean * noisy).sum()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_module_with_a_call_left_in_stage_2_keeps_its_weights_and_stays_exact(size):
    step = HalfCached()
    x = torch.randn(size, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    verdicts = {(v.path, v.index): v.verdict for v in split.plan.verdicts}
    assert verdicts == {("encoder", 0): Verdict.CACHED, ("encoder", 1): Verdict.RANDOM_INPUT}
    assert list(split.boundary) == ["x", "encoder__0__out"]
    assert "encoder.weight" in dict(split.stage2.named_parameters())
    assert all(c.ok for c in graphsplit.verify(step, split, (x,), seed=size))


class NumpyAfter(Frozen):
    """numpy and Python draws after the cached call: stage 2 makes them in the same order."""

    def forward(self, x):
        h = self.encoder(x)
        mask = torch.from_numpy(np.random.rand(*h.shape) > 0.5).to(h.dtype)
        return self.head(h * mask * random.random()).sum()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_numpy_and_python_draws_after_a_cached_call_replay_in_stage_2(size):
    step = NumpyAfter()
    x = torch.randn(size, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    assert split.plan.verdicts[0].verdict is Verdict.CACHED
    cached = split.stage1(x)
    np.random.seed(11)
    random.seed(11)
    expected = step(x)
    np.random.seed(11)
    random.seed(11)
    assert torch.equal(split.stage2(**cached), expected)


def test_stage1_leaves_every_generator_where_it_was():
    step = NumpyAfter()
    x = torch.randn(2, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")

    def seed_and_draw(run_stage1: bool) -> tuple:
        torch.manual_seed(1)
        np.random.seed(1)
        random.seed(1)
        if run_stage1:
            split.stage1(x)
        return torch.rand(1).item(), np.random.rand(), random.random()

    assert seed_and_draw(run_stage1=True) == seed_and_draw(run_stage1=False)


class BatchStatistics(Frozen):
    """A frozen encoder that normalises over the batch: a cached row would depend on its batch."""

    def forward(self, x):
        h = self.encoder(x)
        return self.head(h - h.mean(dim=0, keepdim=True)).sum()


class MixingEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)

    def forward(self, x):
        h = self.linear(x)
        return h - h.mean(dim=0, keepdim=True)


class MixesSamples(Frozen):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = MixingEncoder()

    def forward(self, x):
        return self.head(self.encoder(x)).sum()


class RunningStats(Frozen):
    """A frozen BatchNorm left in training mode writes its running statistics every call."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.BatchNorm1d(HIDDEN).requires_grad_(False)

    def forward(self, x):
        return self.head(self.encoder(x)).sum()


def test_a_call_that_mixes_the_batch_samples_is_not_cached():
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(MixesSamples(), (torch.randn(3, HIDDEN),), path="calls")
    assert f"encoder call 0: {Verdict.MIXES_SAMPLES.why} (out)" in str(caught.value)


def test_batch_statistics_outside_the_frozen_call_are_stage_2_work():
    step = BatchStatistics()
    x = torch.randn(3, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    assert split.plan.verdicts[0].verdict is Verdict.CACHED
    assert all(c.ok for c in graphsplit.verify(step, split, (x,)))


def test_a_call_that_writes_its_modules_buffers_is_not_cached():
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(RunningStats(), (torch.randn(3, HIDDEN),), path="calls")
    detail = "(the call mutates its inputs or its module's buffers)"
    assert f"encoder call 0: {Verdict.MUTATED.why} {detail}" in str(caught.value)


class PerSampleCalls(Frozen):
    """The frozen encoder called once per sample on an unbatched row: no call may be stored
    once as a constant (each depends on its sample)."""

    def forward(self, x):
        rows = [self.encoder(row) for row in x]
        return self.head(torch.stack(rows)).sum()


class ConstantCall(Frozen):
    """A frozen call on a per-dataset constant (InstructPix2Pix's null conditioning)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("null", torch.zeros(1, HIDDEN))

    def forward(self, x):
        null = self.encoder(self.null)
        return self.head(x + null).sum()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_per_sample_calls_on_unbatched_rows_are_never_cached_as_constants(size):
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(PerSampleCalls(), (torch.randn(size, HIDDEN),), path="calls")
    message = str(caught.value)
    assert f"encoder call 0: {Verdict.NOT_PER_SAMPLE.why}" in message
    assert "cached" not in message.split("fix:")[0].replace("be cached", "")


@pytest.mark.parametrize("size", [2, 3])
def test_a_call_on_a_constant_is_cached_once(size):
    step = ConstantCall()
    x = torch.randn(size, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    assert split.boundary["encoder__0__out"].batch_dim is None
    assert all(c.ok for c in graphsplit.verify(step, split, (x,)))


class UnbatchedConstantCall(ConstantCall):
    def __init__(self) -> None:
        super().__init__()
        self.null = torch.zeros(HIDDEN)


def test_a_call_on_a_constant_at_batch_one_is_not_cached_and_says_why():
    with pytest.raises(graphsplit.SplitError, match="split with two or more samples"):
        graphsplit.split(UnbatchedConstantCall(), (torch.randn(1, HIDDEN),), path="calls")


def test_at_batch_one_a_call_whose_input_has_size_one_first_caches_per_sample():
    step = ConstantCall()
    x = torch.randn(1, HIDDEN)
    split = graphsplit.split(step, (x,), path="calls")
    assert split.boundary["encoder__0__out"].batch_dim == 0
    assert all(c.ok for c in graphsplit.verify(step, split, (x,)))
