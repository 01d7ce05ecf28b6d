"""``planning.rounds``: a module mixing frozen and trainable parameters is traced into."""

from __future__ import annotations

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
