"""``planning.rounds``: a module mixing frozen and trainable parameters is traced into."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import (
    batch,
    boundary_summary,
    param_names,
    split_and_verify,
)


class ModuleMixingFrozenAndTrainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
        self.block[0].requires_grad_(False)

    def forward(self, x):
        return self.block(x).mean()


def test_module_mixing_frozen_and_trainable_parameters_is_traced_into():
    model = ModuleMixingFrozenAndTrainable()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"block_1": ((3, 8), 0, 32)}
    assert param_names(split.stage1, model) == {"block.0.weight", "block.0.bias"}
    assert param_names(split.stage2, model) == {"block.2.weight", "block.2.bias"}
    assert any("traced into block" in note for note in split.notes)
    assert "traced into block" in split.report()


class ChecksItsInput(nn.Module):
    """Library-style code that raises on a traced value (not a TraceError)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.trainable = nn.Linear(4, 1)

    def forward(self, x):
        if type(x) is not torch.Tensor:  # the tracer's values pass isinstance, not type()
            raise RuntimeError("expected a tensor")
        return self.trainable(self.frozen(x))


class FoldsTheBatch(nn.Module):
    """Its frozen half works on a (2B, ...) fold: no per-sample value to cache inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.trainable = nn.Linear(4, 1)

    def forward(self, x):
        folded = self.frozen(x.reshape(-1, 4))
        return self.trainable(folded).reshape(x.shape[0], -1)


class Wraps(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x).mean()


def test_a_module_that_fails_to_trace_into_is_kept_whole_with_a_note():
    model = Wraps(ChecksItsInput())
    split = split_and_verify(model, (batch(3, 4),))
    note = next(note for note in split.notes if note.startswith("kept block whole"))
    assert "RuntimeError: expected a tensor" in note
    assert "kept block whole" in split.report()


def test_a_finer_trace_without_a_valid_cut_falls_back_to_the_coarser_split():
    model = Wraps(FoldsTheBatch())
    # path="trace": "auto" then takes the module-level path (tests/test_auto_choice.py)
    split = split_and_verify(model, (batch(3, 2, 4),), path="trace")
    note = next(note for note in split.notes if note.startswith("kept block whole"))
    assert "no valid cut" in note
