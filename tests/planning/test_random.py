"""Every torch random draw is a stage-2 node, whatever its arguments; planning draws nothing."""

from __future__ import annotations

import torch
from torch import nn

import graphsplit
from tests.helpers import split_and_verify


class DrawsWithoutTracedInputs(nn.Module):
    """Draws as real training code writes them: no traced argument, explicit devices."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.register_buffer("sigmas", torch.linspace(0.0, 1.0, 1000))

    def forward(self, x):
        latents = self.encoder(x)
        step = torch.randint(0, 1000, (1,))  # DiffSynth's FlowMatchSFTLoss
        u = torch.normal(mean=0.0, std=1.0, size=(latents.shape[0],), device="cpu")  # diffusers
        offset = torch.rand(4)
        order = torch.randperm(4)
        keep = torch.bernoulli(torch.full((4,), 0.5))
        noise = torch.empty(4).normal_()
        sigma = self.sigmas[step]  # a real tensor indexed by a traced index
        mixed = latents[:, order] * keep + offset + noise
        return self.head(mixed * sigma + u[:, None]).mean()


def test_draws_without_traced_inputs_happen_in_stage_2_in_order():
    model = DrawsWithoutTracedInputs()
    x = torch.randn(3, 4)
    before = torch.get_rng_state()
    split = split_and_verify(model, (x,))
    draws = [node.name for node in split.stage2.graph.nodes if node.op == "call_function"]
    expected = ["randint", "normal", "rand", "randperm", "bernoulli", "functional_inplace"]
    assert [name for name in draws if name in expected] == expected
    assert "self.encoder" not in split.stage2.code
    assert set(split.boundary) == {"encoder"}
    # The analysis drew nothing: the same seed gives the same numbers before and after.
    torch.set_rng_state(before)
    graphsplit.split(model, (x,))
    assert torch.equal(torch.get_rng_state(), before)


class DrawsFromItsGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x):
        return (self.encoder(x) * torch.rand((1,), generator=self.generator)).sum()


def test_a_generator_argument_is_drawn_from_in_stage_2_and_untouched_by_planning():
    model = DrawsFromItsGenerator()
    x = torch.randn(3, 4)
    state = model.generator.get_state()
    split = graphsplit.split(model, (x,))
    assert torch.equal(model.generator.get_state(), state)
    assert "generator = " in split.stage2.code and "self.encoder" not in split.stage2.code
    expected = model(x)
    model.generator.set_state(state)
    assert torch.equal(split.stage2(**split.stage1(x)), expected)
