"""An unstored input's ``.device`` (``calls/unstored_inputs/``): where stage 2's batch is.

DETR's ``DetrModel.forward`` reads ``device = pixel_values.device`` to build its pixel mask and
position embeddings, and passes the pixels to nothing but its frozen backbone. The stand-in
stage 2 holds for such an input lives on ``meta``; its ``.device`` answers the device of stage
2's batch (its other tensors: the training device the user moved the cached batch to), so the
input need not be stored. Where that device is not certain (the batch spread over several
devices, a move to a device not named exactly) a read raises; where stage 2's batch would hold
no other tensor, the input stays stored.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphsplit.calls.unstored_inputs.stand_in import UnstoredInput, stand_in
from graphsplit.errors import SplitError
from tests.helpers import split_and_verify

WIDTH = 4
META = torch.device("meta")


def _x(rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


class PlacesByDevice(nn.Module):
    """``mask = torch.ones(..., device=x.device)`` as DETR builds its pixel mask; ``x`` reaches
    only the frozen encoder; ``target`` (optional) is stored: the loss computes with it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, target=None):
        device = x.device
        mask = torch.arange(x.shape[0], device=device).remainder(2).unsqueeze(1)
        z = self.encoder(x)
        loss = (self.head(z) * mask).square().mean()
        return loss if target is None else loss + (self.head(z) - target).abs().mean()


def test_an_input_read_for_its_device_only_is_not_stored_and_trains_exactly():
    step = PlacesByDevice()
    split = split_and_verify(step, (_x(),), path="calls")
    assert list(split.boundary) == ["x__shape", "encoder__0__out"]
    assert "input 'x' not stored" in split.report()
    reference = copy.deepcopy(step)
    other = _x(5, seed=3)
    loss, expected = split.stage2(**split.stage1(other)), reference(other)
    loss.backward()
    expected.backward()
    assert torch.equal(loss, expected)
    for param, other_param in zip(step.head.parameters(), reference.head.parameters()):
        assert torch.equal(param.grad, other_param.grad)


def test_the_stand_in_answers_the_device_of_the_batchs_other_tensors():
    """Not the device of its own shape rows, nor where stage 1 ran: the cached batch is moved
    to the training device (here ``meta``, the one other device a CPU machine has)."""
    split = split_and_verify(PlacesByDevice(), (_x(),), path="calls")
    spec = next(spec for spec in split.plan.inputs if spec.name == "x")
    batch = split.stage1(_x())
    moved = {"x__shape": batch["x__shape"], "encoder__0__out": batch["encoder__0__out"].to(META)}
    made = spec.gather(moved)
    assert isinstance(made, UnstoredInput) and made.shape == (3, WIDTH)
    assert made.device == META
    assert spec.gather(batch).device == torch.device("cpu")


def test_the_device_is_carried_through_calls_on_the_stand_in():
    made = stand_in("pixel_values", (2, 3), torch.float32, META)
    assert (made.to(torch.float16)[:, :2] * 3).device == META
    assert made.new_zeros(4).device == META and torch.zeros_like(made).device == META
    assert made.to(made.device).device == META
    assert made.to("cpu").device == torch.device("cpu") and made.cpu().device.type == "cpu"
    for unknown in (
        lambda: made.cuda().device,  # the current CUDA device: not named
        lambda: made.to("cuda").device,
        lambda: made.type(torch.float32).device,
        lambda: (made + torch.ones(3)).device,  # a CPU tensor beside a meta one
        lambda: stand_in("pixel_values", (2, 3), torch.float32).device,  # no device given
    ):
        with pytest.raises(SplitError, match=r"reads the \.device of the input 'pixel_values'"):
            unknown()


def test_stage2_refuses_a_device_read_when_its_batch_is_on_several_devices():
    split = split_and_verify(PlacesByDevice(), (_x(), _x(seed=1)[:, :1]), path="calls")
    assert "x" not in split.boundary and "target" in split.boundary
    batch = split.stage1(_x(), _x(seed=1)[:, :1])
    batch["encoder__0__out"] = batch["encoder__0__out"].to(META)  # the target left behind
    with pytest.raises(SplitError) as caught:
        split.stage2(**batch)
    message = str(caught.value)
    assert "reads the .device of the input 'x'" in message
    assert "several devices" in message
    assert "device = x.device" in message  # the user's line
    assert "move every tensor of stage 2's batch to the training device" in message


class DeviceOnly(nn.Module):
    """The encoder's output goes unread: stage 2's batch would hold ``x``'s shape alone, with
    no other tensor to say where it is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        self.encoder(x)
        return self.head(torch.ones(x.shape[0], WIDTH, device=x.device)).square().mean()


def test_an_input_beside_which_stage2s_batch_holds_no_other_tensor_stays_stored():
    split = split_and_verify(DeviceOnly(), (_x(),), path="calls")
    assert "x" in split.boundary and "x__shape" not in split.boundary
    assert (
        "input 'x' stored: the step reads its .device, and stage 2's batch holds no other "
        "tensor to answer that with"
    ) in split.report()
