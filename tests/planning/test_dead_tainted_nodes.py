"""A tainted node nobody reads runs in neither stage, so it must not shape the boundary.

diffusers' ``VectorQuantizer.forward`` returns ``(z_q, loss, (perplexity, min_encodings,
indices))``, its ``loss`` a mean over the whole batch (it mixes samples, so it is tainted);
aMUSEd's training step keeps only the indices. The min-cut drained every tainted node to
stage 2, the dead loss too, so the latents it reads were cached (2 KiB a sample) and the
code lookup redone in stage 2 with the frozen codebook there, where the integer codes
(512 B a sample) are the cheapest cut.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import split_and_verify


class Quantizer(nn.Module):
    """``VectorQuantizer``'s shape: codes, a batch-mean commitment loss, the indices."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)

    def forward(self, z):
        z = z.permute(0, 2, 3, 1).contiguous()
        z_flattened = z.view(-1, 8)
        indices = torch.argmin(torch.cdist(z_flattened, self.embedding.weight), dim=1)
        z_q = self.embedding(indices).view(z.shape)
        loss = torch.mean((z_q.detach() - z) ** 2) + torch.mean((z_q - z.detach()) ** 2)
        return z_q, loss, (None, None, indices)


class MaskedTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Conv2d(3, 8, 1).requires_grad_(False)
        self.quantize = Quantizer().requires_grad_(False)
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16)

    def forward(self, pixels):
        codes = self.quantize(self.encoder(pixels))[2][2].reshape(pixels.shape[0], -1)
        logits = self.head(self.embed(codes))
        return nn.functional.cross_entropy(logits.reshape(-1, 16), codes.reshape(-1))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_codes_are_cached_not_the_latents_a_dead_loss_reads(size):
    model = MaskedTokens()
    pixels = torch.randn(size, 3, 4, 4, generator=torch.Generator().manual_seed(size))
    split = split_and_verify(model, (pixels,))
    assert [(spec.dtype, spec.shape[1:]) for spec in split.boundary.values()] == [
        (torch.int64, (16,))
    ]
    assert not any(name.startswith("quantize") for name, _ in split.stage2.named_parameters())


def test_a_random_draw_nobody_reads_still_runs_in_stage2():
    """Liveness counts every draw: skipping an unused one would shift the draws after it."""

    class DeadDraw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            hidden = self.frozen(x)
            torch.randn_like(hidden)  # dead, but it moves the generator
            return self.head(hidden + torch.randn_like(hidden)).mean()

    split = split_and_verify(DeadDraw(), (torch.randn(2, 4),))
    assert split.stage2.code.count("torch.randn_like(") == 2
