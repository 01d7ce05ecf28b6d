"""A module called as one node of the trace gets plain copies of its dict and list arguments
(fx holds them immutable); one that writes into them is refused, since the step's own code
could read the write afterwards, and ``path="auto"`` takes the module-level path instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.helpers import split_and_verify


class Features(nn.Module):
    """Reads ``features["x"]``; with ``write``, adds its output to the dict (or list)."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.write = write

    def forward(self, features):
        if isinstance(features, list):
            out = self.proj(features[0])
            if self.write:
                features.append(out)
            return out
        out = self.proj(features["x"])
        if self.write:
            features["embedding"] = out
        return out


class Step(nn.Module):
    def __init__(self, write: bool, as_list: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Features(write).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.as_list = as_list

    def forward(self, x, y):
        features = [x] if self.as_list else {"x": x}
        return F.mse_loss(self.head(self.encoder(features)), y)


def _batch():
    return torch.randn(3, 4), torch.randn(3, 1)


@pytest.mark.parametrize("as_list", [False, True])
def test_a_module_reading_a_container_it_is_given_is_split_by_the_trace(as_list):
    split = split_and_verify(Step(write=False, as_list=as_list), _batch(), path="trace")
    assert "encoder" in split.boundary


@pytest.mark.parametrize(("as_list", "kind"), [(False, "dict"), (True, "list")])
def test_a_module_writing_into_a_container_it_is_given_is_refused_by_the_trace(as_list, kind):
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(Step(write=True, as_list=as_list), _batch(), path="trace")
    message = str(caught.value)
    assert f"The module encoder writes into the {kind} it is given" in message
    assert "return F.mse_loss(self.head(self.encoder(features)), y)" in message
    assert 'path="calls"' in message


def test_auto_splits_it_on_the_module_level_path():
    step = Step(write=True)
    split = split_and_verify(step, _batch())
    assert split.path == "calls"
    assert "The module encoder writes into the dict it is given" in split.reason
