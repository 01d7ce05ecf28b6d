"""A model holding frozen and trainable parameters, called under ``torch.no_grad()``.

TRL's DPO with a peft policy and ``ref_model=None`` takes its reference log-probs from the
policy itself, adapters off: ``with torch.no_grad(), model.disable_adapter(): model(...)``. As
one leaf call it reads the LoRA weights under ``no_grad``; traced into, it reads only frozen
ones. The rounds trace into such calls (every mixed module under them at once: one level per
round would run out of rounds on a deep model) and refuse only what is still trainable work
under the switched grad mode once traced into (planning/rules/grad_modes.py,
planning/leaf_rounds.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.planning.rules.grad_modes import NO_GRAD_FIX
from tests.helpers import batch, line_of, split_and_verify

peft = pytest.importorskip("peft")

WIDTH = 8
DEPTH = 10  # more layers than the rounds' limit (8): they must be traced into at once


def _lora_stack() -> nn.Module:
    layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    config = peft.LoraConfig(
        r=2, target_modules=[str(i) for i in range(DEPTH)], init_lora_weights="gaussian"
    )
    model = peft.get_peft_model(layers, config)
    generator = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return model


class AdapterOffReference(nn.Module):
    """The policy with its adapters, the reference without them, under ``no_grad``."""

    def __init__(self, *, disable: bool = True) -> None:
        super().__init__()
        self.model = _lora_stack()
        self.disable = disable

    def forward(self, x, y):
        policy = self.model(x)
        with torch.no_grad():
            if self.disable:
                with self.model.disable_adapter():
                    reference = self.model(x)
            else:
                reference = self.model(x)  # the adapters on: trainable work
        return F.mse_loss(policy - reference, y)


def _xy(size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(size, WIDTH, seed=seed), batch(size, WIDTH, seed=seed + 1)


def test_the_adapter_off_reference_under_no_grad_is_cached():
    torch.manual_seed(0)
    step = AdapterOffReference()
    split = split_and_verify(step, _xy())
    # The reference's last base layer runs in stage 1; stage 2 gets its output.
    last = f"model_base_model_model_{DEPTH - 1}_base_layer_1"
    assert last in {node.name for node in split.cut.stage1}
    assert any(spec.shape == (4, WIDTH) for key, spec in split.boundary.items() if key != "x")
    # Cached under one set of weights, right after an optimizer step moved the adapters.
    boundary = split.stage1(*_xy(seed=5))
    with torch.no_grad():
        for param in step.parameters():
            if param.requires_grad:
                param.add_(0.1)
    torch.manual_seed(1)
    assert torch.equal(split.stage2(**boundary), step(*_xy(seed=5)))


def test_the_adapters_left_on_under_no_grad_are_still_refused():
    step = AdapterOffReference(disable=False)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, _xy(), path="trace")
    message = str(caught.value)
    assert "disables gradients" in message and "lora_" in message
    assert line_of(AdapterOffReference.forward, "the adapters on") in message
    assert NO_GRAD_FIX.words in message
