"""The step's own moves of a frozen module the module-level path caches.

diffusers' scripts with ``--offload`` (train_control_lora_flux.py among them) move their
encoders every step: ``vae.to(accelerator.device)`` before encoding, ``vae.to("cpu")`` after.
A move to where the module already is computes nothing (``Tensor.to`` returns the very
tensor), so it must not make stage 2 hold the weights (calls/usage.py: MOVES); and stage 2,
which may run with those weights on ``meta``, skips the step's moves of a module it does not
hold (calls/holders.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.helpers import batch, split_and_verify


class MovesItsEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.encoder.requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        self.encoder.to(x.device)
        with torch.no_grad():
            features = self.encoder(x)
        self.encoder.to("cpu")  # --offload
        return self.head(features).pow(2).mean()


def _params(split) -> set[str]:
    return {name for name, _ in split.stage2.named_parameters()}


def test_moves_to_where_the_module_is_do_not_make_stage2_hold_it():
    model = MovesItsEncoder()
    split = split_and_verify(model, (batch(3, 4),), path="calls")
    assert _params(split) == {"head.weight", "head.bias"}


def test_stage2_skips_the_steps_moves_of_a_module_it_holds_on_meta():
    """A stage-2 process that never loads the encoder (here: moved to meta after caching)
    trains exactly as the step did; the move used to raise "Cannot copy out of meta tensor"."""
    model = MovesItsEncoder()
    x = batch(3, 4)
    split = graphsplit.split(model, (x,), path="calls")
    torch.manual_seed(0)
    expected = model(x)
    expected.backward()
    grads = [p.grad.clone() for p in model.head.parameters()]
    model.head.zero_grad(set_to_none=True)
    cached = split.stage1(x)
    model.encoder.to("meta")
    torch.manual_seed(0)
    loss = split.stage2(**cached)
    loss.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.head.parameters(), grads))
    assert all(p.is_meta for p in model.encoder.parameters())  # left where the user put it
    assert "_apply" not in vars(model.encoder)  # the skip is only there while a step runs


class ConvertsItsEncoder(MovesItsEncoder):
    """A move that does change the weights (float64 and back) computes: the encoder is held."""

    def forward(self, x):
        self.encoder.to(torch.float64)
        self.encoder.to(torch.float32)
        with torch.no_grad():
            features = self.encoder(x)
        return self.head(features).pow(2).mean()


def test_a_move_that_converts_the_weights_keeps_them_held():
    split = split_and_verify(ConvertsItsEncoder(), (batch(3, 4),), path="calls")
    assert any(name.startswith("encoder") for name in _params(split))


@pytest.mark.parametrize("path", ["auto", "calls"])
def test_the_default_path_also_leaves_the_moved_encoder_out(path):
    split = split_and_verify(MovesItsEncoder(), (batch(3, 4),), path=path)
    assert not any(name.startswith("encoder") for name in _params(split))


class PlacesByTheEncodersDevice(MovesItsEncoder):
    """diffusers' pipelines place the data where the module's weights are (``pipe.device``):
    built on meta in a stage-2 process, the encoder would put the batch there."""

    def forward(self, x):
        device = next(self.encoder.parameters()).device
        with torch.no_grad():
            features = self.encoder(x.to(device))
        return self.head(features).pow(2).mean()


def test_a_module_whose_device_stage2_reads_is_not_held_but_must_stay_off_meta():
    split = split_and_verify(PlacesByTheEncodersDevice(), (batch(3, 4),), path="calls")
    assert not any(name.startswith("encoder") for name in _params(split))
    report = split.report()
    assert "the step reads their weights' .device there" in report
    assert "build them on the training device, not on meta: encoder" in report
    assert "may stay on meta" not in report
    moved = split_and_verify(MovesItsEncoder(), (batch(3, 4),), path="calls")
    assert "may stay on meta): encoder" in moved.report()  # .to(x.device) reads x's, not its
