"""The step and data behind ``tests/caching/data/graphsplit-0.2-format-2``: a cache written by
graphsplit 0.2 (cache format 2) before the second redesign moved every module.

The step has what a real one has: a frozen encoder whose output is diffusers'
``DiagonalGaussianDistribution`` (cached through its codec, so stage 1's code calls the pinned
runtime names), a random draw, a value baked from a size, and a trainable head. Its weights come
from a seed and plain ``torch.nn`` layers, so they are the same on every machine.

Regenerate (only for a new format; the point of the folder is that it is old)::

    python -m tests.caching.format2_fixture
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn

FIXTURE = Path(__file__).parent / "data" / "graphsplit-0.2-format-2"
SAMPLES = 6


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def encode(self, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        return DiagonalGaussianDistribution(self.conv(pixels))


class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder().requires_grad_(False)
        self.text = nn.Embedding(16, 8).requires_grad_(False)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        latents = self.encoder.encode(pixels).sample() * 0.18215
        context = self.text(ids).mean(dim=1)[:, :4, None, None]
        noise = torch.randn_like(latents)
        prediction = self.head(latents + noise + context)
        return F.mse_loss(prediction, noise)


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "pixels": torch.randn(3, 8, 8, generator=generator),
            "ids": torch.randint(0, 16, (5,), generator=generator),
        }
        for _ in range(SAMPLES)
    ]


def example() -> tuple[torch.Tensor, torch.Tensor]:
    rows = dataset()[:2]
    return torch.stack([r["pixels"] for r in rows]), torch.stack([r["ids"] for r in rows])


def main() -> None:
    import shutil

    from torch.utils.data import DataLoader

    import graphsplit

    step = Step()
    split = graphsplit.split(step, args=example())
    shutil.rmtree(FIXTURE, ignore_errors=True)
    graphsplit.cache(split, DataLoader(dataset(), batch_size=2), FIXTURE, progress=False)
    print(split.stage1.code)


if __name__ == "__main__":
    main()
