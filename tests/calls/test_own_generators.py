"""A step that draws from a ``torch.Generator`` of its own (``calls/generators.py``).

InstructPix2Pix's script draws its conditioning dropout with ``torch.rand(bsz,
generator=generator)`` from a generator made in ``main()``. Splitting, caching and verifying
must leave that generator where they found it (else the split run's training draws differ from
the unsplit run's), a frozen call fed by one of its draws is random (never cached), and
``verify`` runs the step and the split from the same state of it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls import Verdict, generators
from tests.helpers import line_of


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


def test_verify_does_not_depend_on_other_splits_generators_alive_in_the_process():
    """Stage 1 (forked) handed every generator any split had seen to the seeded verify around
    it, so this step's generator was seeded by its place in a set that also held other steps'
    generators, and stage 2 started from another seed than the eager run: a verify that failed
    depending on what else the process held (seen in the full suite, on LTX-Video's step)."""
    others = [torch.Generator().manual_seed(index) for index in range(40)]
    for other in others:  # as other splits' steps, still alive, leave them
        generators.KNOWN.add(other)
    step = DrawsFromItsGenerator(_generator())
    split = graphsplit.split(step, (X[:3],), path="calls")
    for seed in range(4):
        assert all(c.ok for c in graphsplit.verify(step, split, (X[:3],), seed=seed))
    assert len(others) == 40  # kept alive to the end


# -- the step's own Python-level generators (random.Random, NumPy) ---------------------------
class DrawsWithNumpy(nn.Module):
    """A data-dependent scale drawn from the step's own NumPy generator, and a frozen call fed
    by a NumPy draw: the trace would freeze both numbers into its plan."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.masked = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.rng = np.random.default_rng(7) if kind == "numpy" else random.Random(7)

    def forward(self, x):
        h = self.encoder(x)
        scale = float(self.rng.uniform(0.5, 1.5))  # the numpy / random spelling alike
        return (self.head(h + self.masked(x * scale)) * scale).square().mean()


def _rng_state(step):
    rng = step.rng
    return rng.bit_generator.state if hasattr(rng, "bit_generator") else rng.getstate()


@pytest.mark.parametrize("kind", ["numpy", "random"])
def test_the_trace_refuses_a_draw_from_the_steps_own_python_generator_naming_the_line(kind):
    step = DrawsWithNumpy(kind)
    state = _rng_state(step)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, (X[:3],), path="trace")
    message = str(caught.value)
    module = "numpy.random.Generator" if kind == "numpy" else "random.Random"
    assert f"drawn while tracing from the step's own generator rng ({module})" in message
    assert line_of(DrawsWithNumpy.forward, "scale = float(self.rng.uniform") in message
    assert "fix:    draw with torch" in message
    assert _rng_state(step) == state  # the refused split did not move it


@pytest.mark.parametrize("kind", ["numpy", "random"])
def test_the_default_path_runs_the_draw_every_step_and_caching_does_not_move_it(kind, tmp_path):
    """Two identical steps, one split (falls back to the module-level path) and cached."""
    plain, step = DrawsWithNumpy(kind), DrawsWithNumpy(kind)
    state = _rng_state(step)
    split = graphsplit.split(step, (X[:3],))
    assert split.path == "calls"
    verdicts = {v.path: v.verdict for v in split.plan.verdicts}
    assert verdicts == {"encoder": Verdict.CACHED, "masked": Verdict.RANDOM_INPUT}
    graphsplit.cache(split, [(X[:3],), (X[3:],)], tmp_path / "cache")
    assert all(c.ok for c in graphsplit.verify(step, split, (X[3:],)))
    assert _rng_state(step) == state  # split, cache and verify gave it back
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    for _ in range(2):
        for start in (0, 3):
            rows = graphsplit.collate([cached[row] for row in range(start, start + 3)])
            assert torch.equal(split.stage2(**rows), plain(X[start : start + 3]))


def test_generators_kept_in_a_dict_a_closure_or_a_helper_object_are_found():
    from graphsplit.planning.rules.random_draws import own_generators

    rngs = {"noise": np.random.default_rng(1), "mask": random.Random(2)}
    helper = type("Sampler", (), {})()
    helper.rng = np.random.RandomState(3)

    def step(x):
        scale = rngs["noise"].uniform() + helper.rng.uniform()
        return (x * scale).sum()

    module = DrawsWithNumpy("numpy")
    module.table = [np.random.default_rng(4)]
    module.step_callable = step
    found = own_generators(module)
    assert set(found) == {"rng", "table[0]", "rngs['noise']", "rngs['mask']", "helper.rng"}
    assert found["rngs['noise']"] is rngs["noise"] and found["helper.rng"] is helper.rng
