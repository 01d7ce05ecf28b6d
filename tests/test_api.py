"""Core split on small synthetic steps: structure of the boundary and exactness."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import batch, param_names, split_and_verify


class FrozenEncoderThenHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        self.encoder.requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x, y):
        features = self.encoder(x)
        return F.mse_loss(self.head(features), y)


def test_frozen_encoder_output_is_the_boundary():
    model = FrozenEncoderThenHead()
    split = split_and_verify(model, (batch(3, 8), batch(3, 1, seed=1)))
    assert list(split.boundary) == ["y", "encoder"]
    spec = split.boundary["encoder"]
    assert spec.shape == (3, 4) and spec.batch_dim == 0 and spec.bytes_per_sample == 16
    assert spec.source.endswith(".py:" + spec.source.rsplit(":", 1)[1])
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}
    assert param_names(split.stage1, model) == {
        n for n, _ in model.encoder.named_parameters(prefix="encoder")
    }


def test_stage_code_calls_the_users_modules():
    model = FrozenEncoderThenHead()
    split = split_and_verify(model, (batch(2, 8), batch(2, 1)))
    assert "self.head(" in split.stage2.code
    assert split.stage2.head is model.head
    assert split.stage1.encoder is model.encoder


def test_other_batch_size_runs_the_same_stages():
    model = FrozenEncoderThenHead()
    split = split_and_verify(model, (batch(3, 8), batch(3, 1)))
    x, y = batch(7, 8, seed=3), batch(7, 1, seed=4)
    assert torch.equal(split.stage2(**split.stage1(x, y)), model(x, y))
