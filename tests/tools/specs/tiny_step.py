"""Step specs for the CLI tests: a tiny frozen encoder + trainable head, and broken ones."""

import torch
from torch import nn

from graphsplit import StepSpec


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


class Pairs(torch.utils.data.Dataset):
    """Ten deterministic (x, y) samples with keys, as ``graphsplit cache`` expects."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        return {
            "key": f"pair-{index:02d}",
            "x": torch.randn(8, generator=generator),
            "y": torch.randn(1, generator=generator),
        }


def step() -> StepSpec:
    torch.manual_seed(0)
    return StepSpec(
        TinyStep(), example_args=(torch.randn(3, 8), torch.randn(3, 1)), dataset=Pairs()
    )


def not_a_spec() -> str:
    return "a string"


def raises() -> StepSpec:
    raise RuntimeError("boom")
