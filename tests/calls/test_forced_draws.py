"""Rare random branches drawn with Python's or NumPy's generator (calls/forced_draws).

A caption dropout at p = 0.05 drawn with ``random.random()`` in the step is taken by neither
probe seed; the module-level path used to cache the encoder's call, and a stage-2 step that
dropped the caption trained on the kept caption's embedding, silently.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls import forced_draws
from graphsplit.calls.verdicts import Verdict
from tests.helpers import batch

EMPTY = torch.zeros(4)


class DropsWithPython(nn.Module):
    """``"" if random.random() < p else caption`` before the frozen encoder, per sample."""

    def __init__(self, p: float = 0.05) -> None:
        super().__init__()
        self.p = p
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.vae = nn.Linear(4, 4).requires_grad_(False)  # fed the data alone: cacheable
        self.head = nn.Linear(4, 1)

    def draw(self) -> float:
        return random.random()

    def forward(self, x):
        rows = [EMPTY if self.draw() < self.p else row for row in x]
        with torch.no_grad():
            features = self.encoder(torch.stack(rows)) + self.vae(x)
        return self.head(features).pow(2).mean()


class DropsWithNumpy(DropsWithPython):
    def draw(self) -> float:
        return float(np.random.rand())


def _seed_drawing_below(p: float) -> int:
    for seed in range(1000):
        random.seed(seed)
        np.random.seed(seed)
        if random.random() < p and np.random.rand() < p:
            return seed
    raise AssertionError(p)


@pytest.mark.parametrize("kind", [DropsWithPython, DropsWithNumpy])
def test_a_rare_dropout_branch_keeps_the_encoder_uncached_and_stage2_exact(kind, tmp_path):
    step = kind()
    x = batch(2, 4)
    split = graphsplit.split(step, (x,), path="calls")
    assert not any(key.startswith("encoder__") for key in split.boundary)
    assert "vae__0__out" in split.boundary
    assert "forced to the bottom of their range" in split.report()
    verdicts = {v.path: v.verdict for v in split.plan.verdicts}
    assert verdicts["encoder"] is Verdict.RARE_BRANCH
    random.seed(0)
    np.random.seed(0)
    graphsplit.cache(split, [{"x": x}], tmp_path / "cache", progress=False)
    rows = graphsplit.collate(list(graphsplit.CachedDataset(tmp_path / "cache", split)))
    drop = _seed_drawing_below(step.p)
    random.seed(drop)
    np.random.seed(drop)
    expected = step(x)
    random.seed(drop)
    np.random.seed(drop)
    assert torch.equal(split.stage2(**rows), expected)


class DrawsAfterTheEncoder(DropsWithPython):
    """A draw that steers nothing the encoder sees: its call stays cached."""

    def forward(self, x):
        with torch.no_grad():
            features = self.encoder(x)
        weight = 2.0 if random.random() < self.p else 1.0
        return self.head(features).pow(2).mean() * weight


def test_a_draw_that_steers_no_frozen_call_leaves_it_cached():
    split = graphsplit.split(DrawsAfterTheEncoder(), (batch(2, 4),), path="calls")
    assert "encoder__0__out" in split.boundary
    assert "draws forced to the bottom and the top of their range" in split.report()


class FailsAtTheEnds(DropsWithPython):
    def forward(self, x):
        with torch.no_grad():
            features = self.encoder(x)
        scale = 1.0 / random.random()  # ZeroDivisionError when forced to the bottom
        return self.head(features).pow(2).mean() * scale


def test_a_step_that_fails_at_a_forced_end_keeps_the_seeded_verdicts_and_says_so():
    split = graphsplit.split(FailsAtTheEnds(), (batch(2, 4),), path="calls")
    assert "encoder__0__out" in split.boundary
    assert "failed when those draws were forced" in split.report()


def test_a_step_without_python_draws_runs_no_forced_probe():
    class NoDraws(DropsWithPython):
        def forward(self, x):
            with torch.no_grad():
                features = self.encoder(x)
            return self.head(features).pow(2).mean()

    split = graphsplit.split(NoDraws(), (batch(2, 4),), path="calls")
    assert "forced" not in split.report()


def test_the_draw_functions_are_given_back_and_other_threads_are_never_forced():
    originals = [getattr(owner, name) for owner, name in forced_draws.WATCHED]
    seen: list[float] = []
    with forced_draws.forced(0.0):
        assert random.random() == 0.0 and np.random.uniform(2.0, 4.0) == 2.0
        assert np.random.rand(2, 3).shape == (2, 3)
        worker = threading.Thread(target=lambda: seen.append(random.random()))
        worker.start()
        worker.join()
    assert [getattr(owner, name) for owner, name in forced_draws.WATCHED] == originals
    assert seen and seen[0] != 0.0  # the other thread drew from the generator: not forced
