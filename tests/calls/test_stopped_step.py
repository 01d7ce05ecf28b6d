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
    model[0].flag = "before"
    first, weight, bias = model[0], model[0].weight, model[0].bias
    state = ModuleState.of(list(model.parameters()))
    model.training = False
    model[0].new_attribute = 3
    model[0].flag = "during"
    model[0].flag = "later"
    model[1] = nn.Tanh()
    model[0].weight = nn.Parameter(torch.zeros(2, 2))
    del model[0].bias
    model[0].bias = torch.ones(2)  # a plain tensor where the parameter was
    model[0].extra = nn.Identity()  # a new submodule
    weight.requires_grad_(False)
    state.put_back()
    assert model.training is True
    assert not hasattr(model[0], "new_attribute") and model[0].flag == "before"
    assert isinstance(model[1], nn.ReLU) and model[0] is first
    assert model[0].weight is weight and weight.requires_grad
    assert model[0].bias is bias and dict(model[0].named_parameters())["bias"] is bias
    assert "extra" not in dict(model[0].named_children())


def test_writes_are_followed_in_the_running_thread_only():
    import threading

    model = nn.Linear(2, 2)
    state = ModuleState.of([])
    other = threading.Thread(target=lambda: setattr(model, "written_elsewhere", 1))
    other.start()
    other.join()
    model.written_here = 2
    state.put_back()
    assert model.written_elsewhere == 1 and not hasattr(model, "written_here")


def test_a_stage_1_inside_another_keeps_the_outer_record():
    model = nn.Linear(2, 2)
    outer = ModuleState.of([])
    model.first = 1
    inner = ModuleState.of([])
    model.second = 2
    inner.put_back()
    assert not hasattr(model, "second")
    model.third = 3
    outer.put_back()
    assert not any(hasattr(model, name) for name in ("first", "second", "third"))
