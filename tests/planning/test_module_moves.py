"""The step moving a module to a device while it is analysed (diffusers' Sana script:
``vae = vae.to(accelerator.device)`` in the loop body) neither fails on the analysis view's
``meta`` weights nor changes the split (graphsplit/planning/meta/module_moves.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import split_and_verify


class MovesItsEncoder(nn.Module):
    def __init__(self, move: str) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.move = move

    def forward(self, x):
        if self.move == "to":
            self.encoder = self.encoder.to(x.device)
        elif self.move == "to_dtype":
            self.encoder.to(device=x.device, dtype=torch.float32, non_blocking=True)
        else:
            self.encoder.cpu()
        hidden = self.encoder(x)
        self.encoder.to("cpu")  # --offload
        return self.head(hidden).mean()


@pytest.mark.parametrize("move", ["to", "to_dtype", "cpu"])
def test_a_module_moved_in_the_step_is_still_cached(move):
    model = MovesItsEncoder(move)
    split = split_and_verify(model, (torch.randn(3, 4),))
    assert split.path == "trace"
    assert "encoder" not in {name for name, _ in split.stage2.named_modules()}
    assert all(p.device.type == "cpu" for p in model.parameters())  # the real weights stay


def test_a_dtype_move_still_reaches_the_analysis():
    """``to(dtype=...)`` on the analysis view keeps its dtype: the traced step computes in
    float64 as the eager one does (a float32 trace would not verify bit for bit)."""

    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(4, 4).requires_grad_(False)
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            self.encoder.to(torch.float64)
            return self.head(self.encoder(x.double()).float()).mean()

    model = Half()
    split = split_and_verify(model, (torch.randn(2, 4),))
    assert "encoder" not in {name for name, _ in split.stage2.named_modules()}
