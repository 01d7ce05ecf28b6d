"""Step specs for the CLI tests: a tiny frozen encoder + trainable head, and broken ones."""

import torch
from torch import nn

from graphsplit.spec import StepSpec


class TinyStep(nn.Module):
    """A frozen encoder, noise added in stage 2, a trainable head; returns an MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 6).requires_grad_(False)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.encoder(x)
        noisy = features + torch.randn_like(features)
        return nn.functional.mse_loss(self.head(noisy), y)


def step() -> StepSpec:
    torch.manual_seed(0)
    return StepSpec(TinyStep(), example_args=(torch.randn(3, 8), torch.randn(3, 1)))


def not_a_spec() -> str:
    return "a string"


def raises() -> StepSpec:
    raise RuntimeError("boom")
