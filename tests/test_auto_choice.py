"""``path="auto"`` between a trace that kept a module whole and the module-level path (api.py).

The trace keeps a mixed module whole when tracing into it fails (Gemma 3's vmapped mask); its
stage 2 then runs the frozen weights inside it every step. ``auto`` compares with the
module-level path on that typed signal only (``Plan.kept_whole``), and takes it where its
stage 2 holds fewer frozen bytes and runs on its own stage 1's output.
"""

from __future__ import annotations

import torch
from torch import nn

import graphsplit
from tests.helpers import batch, split_and_verify


class Untraceable(nn.Module):
    """A frozen encoder and a trainable head in one module whose forward fx cannot trace (a
    dict keyed by a traced size); run whole, it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        features = self.encoder(x)
        scale = {features.shape[0]: 1.0}[features.shape[0]]
        return self.head(features * scale)


class Wraps(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x).pow(2).mean()


def _frozen_in_stage2(split) -> list[str]:
    return [name for name, p in split.stage2.named_parameters() if not p.requires_grad]


def test_auto_takes_the_module_level_path_where_the_trace_kept_frozen_work_whole():
    model = Wraps(Untraceable())
    trace = graphsplit.split(model, (batch(3, 4),), path="trace")
    assert any(note.startswith("kept block whole: tracing into it failed") for note in trace.notes)
    assert _frozen_in_stage2(trace) == ["block.encoder.weight", "block.encoder.bias"]
    split = split_and_verify(model, (batch(3, 4),))
    assert split.path == "calls"
    assert _frozen_in_stage2(split) == []
    assert "the whole-step trace kept block whole (tracing into it failed" in split.report()


class ChecksItsInput(Untraceable):
    """As above, but its forward refuses anything that is not exactly a tensor: on the
    module-level path stage 2 would hand it the stand-in of an input it does not store."""

    def forward(self, x):
        if type(x) is not torch.Tensor:
            raise RuntimeError("expected a tensor")
        return super().forward(x)


def test_auto_keeps_the_trace_where_the_module_level_stage2_cannot_run():
    split = split_and_verify(Wraps(ChecksItsInput()), (batch(3, 4),))
    assert split.path == "trace"


class AllTrainableInside(Untraceable):
    """Kept whole, but nothing frozen inside it: no comparison is made."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder.requires_grad_(True)


class FrozenBeside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.block = AllTrainableInside()

    def forward(self, x):
        return self.block(self.frozen(x)).pow(2).mean()


def test_auto_keeps_the_trace_when_the_module_kept_whole_holds_no_frozen_weight():
    split = split_and_verify(FrozenBeside(), (batch(3, 4),))
    assert split.path == "trace"
    assert "frozen" in list(split.boundary)


def test_a_function_step_is_compared_as_the_user_wrote_it():
    block = Untraceable()

    def training_step(x):
        return block(x).pow(2).mean()

    split = graphsplit.split(training_step, (batch(3, 4),))
    assert split.path == "calls"
    assert _frozen_in_stage2(split) == []
    assert all(c.ok for c in graphsplit.verify(training_step, split, (batch(5, 4),)))


def test_a_step_taking_a_dict_batch_is_compared_with_its_fields_spread():
    """The comparison runs the module-level stages on the example as ``verify`` does: a dict
    batch's fields are stage 1's inputs (it used to call ``stage1(batch)``, which raised, and
    kept the trace's plan for every step written ``def step(batch)``)."""
    block = Untraceable()

    def training_step(batch):
        return block(batch["x"]).pow(2).mean()

    split = graphsplit.split(training_step, ({"x": batch(3, 4)},))
    assert split.path == "calls"
    assert _frozen_in_stage2(split) == []
    checks = graphsplit.verify(training_step, split, ({"x": batch(5, 4)},))
    assert checks and all(c.ok for c in checks)


class FoldsTheBatch(nn.Module):
    """Its frozen half runs on ``x.reshape(-1, 4)``: two rows a sample, which the trace cannot
    cut per sample (no valid cut inside it) and the module-level path caches two rows an
    entry."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x.reshape(-1, 4))).reshape(x.shape[0], -1)


def test_auto_compares_where_the_finer_trace_had_no_valid_cut():
    model = Wraps(FoldsTheBatch())
    trace = graphsplit.split(model, (batch(3, 2, 4),), path="trace")
    assert any("no valid cut" in note for note in trace.notes)
    assert trace.plan_set.first.kept_whole == frozenset({"block"})
    assert _frozen_in_stage2(trace) == ["block.encoder.weight", "block.encoder.bias"]
    split = split_and_verify(model, (batch(3, 2, 4),))
    assert split.path == "calls"
    assert _frozen_in_stage2(split) == []
    assert "found no valid cut" in split.report()
