"""An autocast around split(): the boundary's dtypes are the real run's, and a cache made under
another autocast than split() saw is refused (graphsplit/planning/cut/ambient_dtypes.py,
graphsplit/signatures/dispatch.py _refuse_other_dtypes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.signatures.dispatch import OTHER_AUTOCAST_FIX

WIDTH = 8


class ResidualAfterFrozen(nn.Module):
    """A frozen Linear (bfloat16 under autocast), then ops autocast leaves alone: ``h * 1.1``
    runs in h's dtype, so a float32 ``h`` gives another loss than the bfloat16 one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.norm = nn.BatchNorm1d(WIDTH).requires_grad_(False).eval()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = self.norm(self.encoder(x))
        return F.mse_loss(self.head(h).float() + (h * 1.1).float().mean(-1, keepdim=True), y)


def _samples(count: int = 4) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(2, WIDTH, generator=generator),
            "y": torch.randn(2, 1, generator=generator),
            "key": [f"s{i}a", f"s{i}b"],
        }
        for i in range(count)
    ]


def test_an_autocast_around_split_gives_the_boundary_the_dtype_stage1_makes(tmp_path):
    step, batches = ResidualAfterFrozen(), _samples()
    example = (batches[0]["x"], batches[0]["y"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        split = graphsplit.split(step, example)
        spec = split.boundary["norm"]
        assert spec.dtype == torch.bfloat16
        assert spec.bytes_per_sample == WIDTH * 2
        graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
        dataset = graphsplit.CachedDataset(tmp_path / "cache", split=split)
        assert dataset[0][spec.name].dtype == torch.bfloat16
        for index, batch in enumerate(batches):
            rows = graphsplit.collate([dataset[2 * index], dataset[2 * index + 1]])
            expected = step(batch["x"], batch["y"])
            assert torch.equal(split.stage2(**rows), expected)
        # What a float32 header stored (the rows upcast) gives another loss: the test can fail.
        upcast = {**rows, spec.name: rows[spec.name].float()}
        assert not torch.equal(split.stage2(**upcast), expected)


def test_the_run_leaves_buffers_as_they_were():
    step = ResidualAfterFrozen()
    step.norm.train()  # a frozen norm in train mode updates its running stats when it runs
    before = {name: b.clone() for name, b in step.named_buffers()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graphsplit.split(step, (torch.randn(2, WIDTH), torch.randn(2, 1)))
    assert all(torch.equal(before[name], b) for name, b in step.named_buffers())


def test_without_an_autocast_the_analysis_dtypes_stand():
    step = ResidualAfterFrozen()
    split = graphsplit.split(step, (torch.randn(2, WIDTH), torch.randn(2, 1)))
    assert {s.dtype for s in split.boundary.values()} == {torch.float32}


def test_caching_under_another_autocast_than_split_saw_is_refused(tmp_path):
    step, batches = ResidualAfterFrozen(), _samples()
    split = graphsplit.split(step, (batches[0]["x"], batches[0]["y"]))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast, pytest.raises(graphsplit.SplitError) as refusal:
        graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    message = str(refusal.value)
    assert "in torch.bfloat16, where graphsplit.split planned torch.float32" in message
    assert "another autocast than split() ran under" in message
    assert OTHER_AUTOCAST_FIX.words in message
    assert "test_ambient_dtypes.py" in message  # the line that made the tensor


class CastsBackToTheFrozenDtype(nn.Module):
    """peft's LoRA layer, in small: ``result = base(x)``, ``dtype = result.dtype``, the trained
    delta added, the sum cast back to ``dtype``; two uses of it after (rotary's ``q * cos`` and
    ``rotate_half(q) * sin``), whose gradients eager rounds to bfloat16 one by one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.delta = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x, y):
        result = self.base(x)
        dtype = result.dtype
        result = (result + self.delta(x)).to(dtype)
        scale = torch.linspace(0.5, 1.5, WIDTH)
        out = result * scale + result.flip(-1) * scale.flip(-1)
        return F.mse_loss(out.float().sum(-1, keepdim=True), y)


def test_a_dtype_the_trace_read_that_the_autocast_changes_refuses_the_trace():
    step, batches = CastsBackToTheFrozenDtype(), _samples()
    example = (batches[0]["x"], batches[0]["y"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(graphsplit.TraceError) as caught:
            graphsplit.split(step, example, path="trace")
        split = graphsplit.split(step, example)  # auto: the module-level path
        assert split.path == "calls"
        assert all(check.ok for check in graphsplit.verify(step, split, example))
    message = str(caught.value)
    assert "The step reads the dtype of a tensor the autocast around graphsplit.split" in message
    assert "makes in torch.bfloat16, where graphsplit's analysis" in message
    assert "result = self.base(x)" in message  # the line that made it
    assert 'path="calls"' in message


def test_a_dtype_read_the_autocast_leaves_alone_keeps_the_trace():
    """Without an autocast, or where the run's dtype is the analysis's, nothing is refused."""
    step, batches = CastsBackToTheFrozenDtype(), _samples()
    example = (batches[0]["x"], batches[0]["y"])
    split = graphsplit.split(step, example)
    assert split.path == "trace"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert graphsplit.split(step, example).path == "trace"
