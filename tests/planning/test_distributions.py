"""Draws from ``torch.distributions`` with constant parameters split exactly (issue 24, item 4).

torchvision-v2-style MixUp draws its mixing weight as ``Beta(α, α).sample(())`` from a
distribution built in ``__init__``. A distribution draws with one of torch's random functions
(``torch._sample_dirichlet``, ``torch._standard_gamma``, ``torch.binomial``, ``torch.normal``,
``Tensor.exponential_`` ...); with constant parameters its argument is a real tensor, and the
trace records it as one node, so stage 2 draws every step, in the step's order: the split's
loss and gradients equal the unsplit step's bit for bit for the same seed. Each step is split
and verified at batch sizes 1, 2 and 3, with torch draws before and after the distribution's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import distributions as D
from torch import nn

from graphsplit.planning.patching.torch_calls import RANDOM_FUNCTIONS
from tests.helpers import batch, frozen, split_and_verify


class MixUp(nn.Module):
    """torchvision v2's MixUp, on frozen features: the distribution is an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self._dist = D.Beta(torch.tensor([0.4]), torch.tensor([0.4]))

    def forward(self, x, y):
        noise = torch.randn_like(x)  # a torch draw before the distribution's ...
        lam = self._dist.sample(())
        f = self.enc(x + noise)
        mixed = lam * f + (1 - lam) * f.roll(1, 0)
        keep = torch.rand(x.shape[0]) > 0.1  # ... and one after it
        return F.mse_loss(self.head(mixed).squeeze(-1) * keep, y)


class DrawsFrom(nn.Module):
    """A distribution built inside the step from constants, its draw scaling frozen features."""

    def __init__(self, draw) -> None:
        super().__init__()
        self.enc = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.draw = draw

    def forward(self, x, y):
        before = torch.rand(())
        drawn = self.draw().to(x.dtype)
        f = self.enc(x)
        mixed = drawn * f + (1 - drawn) * f.roll(1, 0) + before
        return F.mse_loss(self.head(mixed).squeeze(-1), y)


DRAWS = {
    "beta": lambda: D.Beta(torch.tensor(0.4), torch.tensor(0.4)).sample(()),
    "beta_rsample": lambda: D.Beta(torch.tensor([0.4, 0.5]), torch.tensor(0.4)).rsample().sum(),
    "dirichlet": lambda: D.Dirichlet(torch.ones(3)).rsample().sum(),
    "gamma": lambda: D.Gamma(torch.tensor([2.0]), torch.tensor([1.0])).sample((2,)).sum(),
    "chi2": lambda: D.Chi2(torch.tensor([2.0])).sample().sum(),
    "student_t": lambda: D.StudentT(torch.tensor(2.0)).sample(),
    "binomial": lambda: D.Binomial(10, torch.tensor(0.3)).sample(),
    "poisson": lambda: D.Poisson(torch.tensor(3.0)).sample(),
    "normal": lambda: D.Normal(0.0, 1.0).sample((3,)).sum(),
    "categorical": lambda: D.Categorical(torch.ones(4)).sample(),
    "exponential": lambda: D.Exponential(torch.tensor(1.0)).sample(),
}


@pytest.mark.parametrize("size", [1, 2, 3])
def test_mixup_with_a_beta_attribute_draws_in_stage2_every_step(size):
    model = MixUp()
    split = split_and_verify(model, (batch(size, 4), batch(size, seed=1)))
    assert "_sample_dirichlet" in split.stage2.code
    assert "_sample_dirichlet" not in split.stage1.code
    # Two steps, two different mixing weights: the draw is not frozen into the plan.
    x, y = batch(size, 4, seed=2), batch(size, seed=3)
    inputs = split.stage1(x, y)
    torch.manual_seed(0)
    first = split.stage2(**inputs)
    torch.manual_seed(0)
    assert torch.equal(first, model(x, y))
    assert not torch.equal(split.stage2(**inputs), first)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_a_draw_from_a_constant_distribution_splits_exactly(name, size):
    split_and_verify(DrawsFrom(DRAWS[name]), (batch(size, 4), batch(size, seed=1)))


def test_gamma_draws_the_same_bits_and_gradients_as_torchs_own_rsample():
    """The trace's out-of-place clamp (distribution_draws.py), subnormal samples included."""
    from graphsplit.planning.patching.distribution_draws import gamma_clamped_out_of_place
    from graphsplit.planning.patching.patcher import Patcher

    class NotComputingMeta:
        computing_meta = False

    concentration = torch.full((2000,), 0.5, requires_grad=True)
    rate = torch.tensor(1e38, requires_grad=True)
    torch.manual_seed(0)
    expected = D.Gamma(concentration, rate).rsample()
    expected.sum().backward()
    gradients = concentration.grad.clone(), rate.grad.clone()
    concentration.grad = rate.grad = None
    with Patcher() as patcher:
        gamma_clamped_out_of_place(patcher, NotComputingMeta())
        torch.manual_seed(0)
        drawn = D.Gamma(concentration, rate).rsample()
    drawn.sum().backward()
    assert (expected == torch.finfo(torch.float32).tiny).any()  # clamped (subnormal draws)
    assert torch.equal(drawn, expected)
    assert torch.equal(concentration.grad, gradients[0]) and torch.equal(rate.grad, gradients[1])


def test_the_samplers_distributions_use_are_recorded_draws():
    assert {torch._sample_dirichlet, torch._standard_gamma, torch.binomial} <= RANDOM_FUNCTIONS


def test_the_meta_samplers_are_registered_for_the_analysis_only():
    # torch ships no Meta kernel for these samplers; the analysis registers shape-only ones
    # for its own length and removes them, so torch's dispatcher is as it was after a split.
    def has_meta(name: str) -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta")

    before = {name: has_meta(name) for name in ("_sample_dirichlet", "binomial")}
    split_and_verify(MixUp(), (batch(2, 4), batch(2, seed=1)))
    assert {name: has_meta(name) for name in before} == before
    split_and_verify(MixUp(), (batch(3, 4), batch(3, seed=1)))  # registered again
    assert {name: has_meta(name) for name in before} == before
