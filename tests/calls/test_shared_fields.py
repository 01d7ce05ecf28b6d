"""A frozen call returning one tensor under two fields (module-level path).

``SegformerModel`` returns ``last_hidden_state is hidden_states[-1]``; the plan used to store
that tensor under both fields' keys. It is now stored once (``CachedCall.shared``), stage 2
hands out one tensor for both fields, as the call did, and stage 1 refuses a batch whose call
returns two tensors there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.errors import SplitError
from tests.conformance.unseen_checks import assert_cache_round_trip


class Encoder(nn.Module):
    """Returns its last feature map under two names, as SegFormer's encoder does."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 5)
        self.copy_last = False

    def forward(self, x):
        states = (self.first(x), self.second(self.first(x)))
        last = states[-1].clone() if self.copy_last else states[-1]
        return {"last_hidden_state": last, "hidden_states": states}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder().requires_grad_(False)
        self.head = nn.Linear(11, 1)
        self.seen_one_tensor: list[bool] = []

    def forward(self, x):
        out = self.encoder(x)
        self.seen_one_tensor.append(out["last_hidden_state"] is out["hidden_states"][-1])
        features = torch.cat([*out["hidden_states"]], dim=-1)
        return (self.head(features).squeeze(-1) + out["last_hidden_state"].sum(-1)).mean()


def _x(seed: int, size: int) -> torch.Tensor:
    return torch.randn(size, 4, generator=torch.Generator().manual_seed(seed))


def test_one_tensor_under_two_fields_is_stored_once_and_answered_as_one(tmp_path):
    torch.manual_seed(0)
    step = Head()
    split = graphsplit.split(step, (_x(0, 3),), path="calls")
    planned = split.plan.cached[("encoder", 0)]
    assert planned.shared == {"hidden_states__1": "last_hidden_state"}
    stored = sorted(key for key in split.boundary if key.startswith("encoder__0__"))
    assert stored == ["encoder__0__hidden_states__0", "encoder__0__last_hidden_state"]
    assert "hidden_states__1 (is last_hidden_state)" in split.report()
    for size in (3, 2):
        assert all(c.ok for c in graphsplit.verify(step, split, (_x(1, size),)))
    step.seen_one_tensor.clear()
    assert_cache_round_trip(split, step, [_x(2, 2), _x(3, 2)], tmp_path, step, rows_per_batch=2)
    assert step.seen_one_tensor and all(step.seen_one_tensor)  # stage 2 as eager: one tensor


def test_two_tensors_where_the_example_had_one_are_refused(tmp_path):
    torch.manual_seed(0)
    step = Head()
    split = graphsplit.split(step, (_x(0, 3),), path="calls")
    step.encoder.copy_last = True
    with pytest.raises(SplitError) as caught:
        graphsplit.cache(split, [(_x(1, 2),)], tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "encoder call 0 returned its hidden_states__1 as the very tensor of its " in message
    assert "last_hidden_state on the example batch, and a tensor of its own on this one" in message
    assert "fix:" in message
