"""Stage 1 stops the step at its last cached call and puts back what the step changed in its
modules before the stop (graphsplit/calls/stopped_step).

Found through diffusers' Diffusion-DPO script (tests/conformance/test_unseen7_diffusion_dpo.py):
``unet.disable_adapters()``, the reference call, ``unet.enable_adapters()``. Once a frozen
layer inside the reference call was cached, stage 1 stopped there, the adapters stayed
disabled (their parameters no longer requiring grad), and every later step trained the
policy as the reference: a loss of log 2 and no LoRA gradient.
"""

from __future__ import annotations

import torch
from torch import nn

import graphsplit
from graphsplit.calls.stopped_step import ModuleState
from tests.helpers import batch


class ReferenceByFlag(nn.Module):
    """The reference prediction is the policy's with its adapter switched off by the step."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.base = nn.Linear(4, 4).requires_grad_(False)
        self.adapter = nn.Linear(4, 4)
        self.adapter_on = True

    def predict(self, h):
        out = self.base(h)
        return out + self.adapter(h) if self.adapter_on else out

    def forward(self, x):
        h = self.encoder(x)
        policy = self.predict(h)
        self.adapter_on = False  # as peft's disable_adapters()
        self.adapter.requires_grad_(False)
        with torch.no_grad():
            reference = self.predict(h)
        self.adapter_on = True  # as enable_adapters()
        self.adapter.requires_grad_(True)
        return (policy - reference).pow(2).mean() + policy.mean()


def test_stage_1_puts_back_the_state_the_step_changed_before_its_stop():
    torch.manual_seed(0)
    step = ReferenceByFlag()
    split = graphsplit.split(step, (batch(2, 4),), path="calls")
    assert split.plan.last == ("base", 1)  # stage 1 stops inside the reference prediction
    split.stage1(batch(2, 4))
    assert step.adapter_on is True
    assert all(param.requires_grad for param in step.adapter.parameters())
    for seed, size in enumerate([2, 3]):
        checks = graphsplit.verify(step, split, (batch(size, 4, seed=seed),), seed=seed)
        assert checks and all(check.ok for check in checks)


def test_module_state_puts_back_attributes_held_modules_and_flags():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    first, weight = model[0], model[0].weight
    state = ModuleState.of(model)
    model.training = False
    model[0].new_attribute = 3
    model[1] = nn.Tanh()
    model[0].weight = nn.Parameter(torch.zeros(2, 2))
    model[0].register_buffer("scale", torch.ones(1))
    weight.requires_grad_(False)
    state.put_back()
    assert model.training is True
    assert not hasattr(model[0], "new_attribute")
    assert isinstance(model[1], nn.ReLU) and model[0] is first
    assert model[0].weight is weight and weight.requires_grad
    assert "scale" not in dict(model[0].named_buffers())
