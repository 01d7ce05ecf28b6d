"""A step that draws from a ``torch.Generator`` of its own (``calls/generators.py``).

InstructPix2Pix's script draws its conditioning dropout with ``torch.rand(bsz,
generator=generator)`` from a generator made in ``main()``. Splitting, caching and verifying
must leave that generator where they found it (else the split run's training draws differ from
the unsplit run's), a frozen call fed by one of its draws is random (never cached), and
``verify`` runs the step and the split from the same state of it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls import Verdict


class DrawsFromItsGenerator(nn.Module):
    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.masked = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.generator = generator

    def forward(self, x):
        keep = (torch.rand(x.shape[0], 1, generator=self.generator) < 0.5).float()
        h = self.encoder(x)
        return self.head(h + self.masked(x * keep)).square().mean()


X = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(3)


@pytest.mark.parametrize("path", ["calls", "trace"])
def test_split_cache_and_verify_leave_the_steps_generator_where_they_found_it(path, tmp_path):
    generator = _generator()
    step = DrawsFromItsGenerator(generator)
    state = generator.get_state()
    split = graphsplit.split(step, (X[:3],), path=path)
    assert torch.equal(generator.get_state(), state)
    graphsplit.cache(split, [(X[:3],), (X[3:],)], tmp_path / "cache")
    assert torch.equal(generator.get_state(), state)
    assert all(c.ok for c in graphsplit.verify(step, split, (X[3:],), seed=5))
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize("path", ["calls", "trace"])
def test_training_from_the_cache_draws_what_the_unsplit_run_draws(path, tmp_path):
    """Two identical runs, one split and cached first: every step's loss bit for bit."""
    plain = DrawsFromItsGenerator(_generator())
    step = DrawsFromItsGenerator(_generator())
    split = graphsplit.split(step, (X[:3],), path=path)
    graphsplit.cache(split, [(X[:3],), (X[3:],)], tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    for epoch in range(2):
        for start in (0, 3):
            rows = graphsplit.collate([cached[row] for row in range(start, start + 3)])
            torch.manual_seed(epoch)
            expected = plain(X[start : start + 3])
            torch.manual_seed(epoch)
            assert torch.equal(split.stage2(**rows), expected)


def test_a_frozen_call_fed_by_the_steps_generator_is_random_not_cached():
    split = graphsplit.split(DrawsFromItsGenerator(_generator()), (X[:3],), path="calls")
    verdicts = {v.path: v.verdict for v in split.plan.verdicts}
    assert verdicts == {"encoder": Verdict.CACHED, "masked": Verdict.RANDOM_INPUT}


def test_verify_compares_the_step_and_the_split_from_one_state_of_the_generator():
    """Before, the unsplit run moved the generator and the split run drew other masks: a false
    mismatch (InstructPix2Pix's zero-initialised conv_in channels hid it from the loss)."""
    step = DrawsFromItsGenerator(_generator())
    split = graphsplit.split(step, (X[:3],), path="trace")
    for seed in range(4):
        assert all(c.ok for c in graphsplit.verify(step, split, (X[:3],), seed=seed))
