"""Each stage lists its parameters, buffers and submodules in the model's order, not graph order."""

from __future__ import annotations

import torch
from torch import nn

import graphsplit


class UsedInReverseOrder(nn.Module):
    """Registers ``first``, ``blocks`` (two nested layers), ``last``; runs them last to first,
    so fx registers the stages' attributes in the opposite order."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.first = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(2)
        )
        self.register_buffer("scale", torch.ones(4))
        self.last = nn.Linear(4, 4)

    def forward(self, x):
        hidden = self.last(self.encoder(x)) * self.scale
        for block in reversed(self.blocks):
            hidden = block[1](block[0](hidden))
        return self.first(hidden).pow(2).mean()


def _in_model_order(names, model_names):
    held = set(names)
    return [name for name in model_names if name in held]


def test_stage2_follows_the_model_registration_order():
    model = UsedInReverseOrder()
    split = graphsplit.split(model, (torch.randn(3, 4),))
    stage2 = split.stage2
    parameters = [name for name, _ in stage2.named_parameters()]
    model_parameters = [name for name, _ in model.named_parameters()]
    assert parameters == _in_model_order(parameters, model_parameters)
    assert parameters[0].startswith("first.")  # graph order would start with last.*
    buffers = [name for name, _ in stage2.named_buffers()]
    assert buffers == _in_model_order(buffers, [name for name, _ in model.named_buffers()])
    modules = [name for name, _ in stage2.named_modules() if name]
    assert modules == _in_model_order(modules, [name for name, _ in model.named_modules()])
    # The optimizer's view: the same parameter objects, position by position.
    by_name = dict(model.named_parameters())
    assert [id(p) for p in stage2.parameters()] == [id(by_name[name]) for name in parameters]


def test_containers_fx_makes_are_ordered_and_hold_the_model_modules():
    model = UsedInReverseOrder()
    split = graphsplit.split(model, (torch.randn(3, 4),))
    blocks = split.stage2.get_submodule("blocks")
    assert blocks is not model.blocks  # fx made it: graph order would list "1" first
    assert list(blocks._modules) == ["0", "1"]
    assert split.stage2.get_submodule("blocks.0.0") is model.blocks[0][0]
