"""The module-level path's planning runs leave the model's tensors as they found them.

``split_calls`` runs the step for real several times. What the step writes into the model's
buffers (a queue, BatchNorm's running statistics) is put back after the split, made or refused;
a frozen parameter whose tensor the step replaces (MoCo's ``param_k.data = ...``) gets its own
back; and a split that would cache a module whose frozen weights the step moves is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.calls.stopped_step.written_tensors import FrozenParameters


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], module: nn.Module) -> list[str]:
    after = module.state_dict()
    return [name for name, value in before.items() if not torch.equal(value, after[name])]


class QueueStep(nn.Module):
    """A frozen encoder cached, a trainable head, and a queue of past features (a buffer the
    step writes every step, as MoCo's ``_dequeue_and_enqueue``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(6, 8).requires_grad_(False).eval()
        self.head = nn.Linear(8, 8)
        self.register_buffer("queue", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.encoder(x)
        out = self.head(features)
        loss = (out @ self.queue.T).pow(2).mean() + out.pow(2).mean()
        with torch.no_grad():
            self.queue.copy_(torch.roll(self.queue, 1, 0))
            self.queue[0] = out.detach().mean(0)
        return loss


def test_buffers_written_by_the_planning_runs_are_put_back():
    step = QueueStep()
    before = _state(step)
    split = graphsplit.split(step, (torch.randn(3, 6),), path="calls")
    assert _changed(before, step) == []  # the queue as it was
    assert split.plan.cached  # the encoder's call
    # and the step still trains exactly from its stages (the queue moves as in eager)
    x = torch.randn(3, 6)
    eager, stages = QueueStep(), step
    stages.load_state_dict(eager.state_dict())
    boundary = {key: value.detach() for key, value in split.stage1(x).items()}
    assert torch.equal(split.stage2(**boundary), eager(x))
    assert torch.equal(stages.queue, eager.queue)


class MomentumStep(nn.Module):
    """A frozen target network synced from the trained one inside the step, every step (a
    momentum update with m = 0, as a DQN-style hard update): its weights change between steps
    while each run's call of it looks per sample."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = nn.Linear(6, 8)
        self.key = nn.Linear(6, 8).requires_grad_(False)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for param_q, param_k in zip(self.query.parameters(), self.key.parameters()):
                if self.in_place:
                    param_k.data.copy_(param_q.data)
                else:
                    param_k.data = param_q.data.clone()
            keys = self.key(x)
        return F.mse_loss(self.query(x), keys)


def test_a_cached_module_whose_frozen_weights_the_step_replaces_is_refused_and_put_back():
    step = MomentumStep(in_place=False)
    before = _state(step)
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (torch.randn(3, 6),), path="calls")
    message = str(caught.value)
    assert "the step writes into the frozen parameter 'key.weight'" in message
    assert "'key' holds it" in message and "outside the step" in message
    assert _changed(before, step) == []  # the momentum updates of the planning runs undone


def test_a_frozen_weight_written_in_place_is_refused_and_named_as_not_put_back():
    step = MomentumStep(in_place=True)
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (torch.randn(3, 6),), path="calls")
    message = str(caught.value)
    assert "the step writes into the frozen parameter 'key.weight'" in message
    assert "those values are not put back" in message and "reload them" in message


def test_a_parameter_only_moved_to_another_dtype_is_no_write():
    encoder = nn.Linear(4, 4).requires_grad_(False)
    state = FrozenParameters(encoder)
    encoder.to(torch.float64)
    assert state.put_back() == ([], [])
    assert encoder.weight.dtype == torch.float64  # left where the step moved it


def test_the_trace_path_and_the_traced_split_leave_buffers_alone():
    """The whole-step trace plans on meta: nothing real runs, nothing to put back."""
    step = QueueStep()
    before = _state(step)
    with pytest.raises(graphsplit.GraphsplitError):
        graphsplit.split(step, (torch.randn(3, 6),), path="trace")
    assert _changed(before, step) == []


def test_the_sampled_places_of_a_long_tensor_stay_inside_it():
    """A float ``linspace`` rounds (2**24 + 3) - 1 past the last index: the places are ints."""
    from graphsplit.calls.stopped_step.written_tensors import _sampled

    flat = torch.arange(2**24 + 3, dtype=torch.int32)
    samples = _sampled(flat)
    assert samples[0] == 0 and samples[-1] == 2**24 + 2 and len(samples) == 8
    assert len(_sampled(torch.ones(1))) == 1 and len(_sampled(torch.ones(0))) == 0
