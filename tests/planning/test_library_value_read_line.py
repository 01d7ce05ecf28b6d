"""A value read inside a module called as one node names the module's own line too.

peft's LoHa / LoKr layers branch on ``torch.rand(1) > module_dropout`` deep inside the model;
the refusal used to name only the step's call of the whole model (planning/meta/meta_failures.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import graphsplit
from tests.helpers import frozen


class ModuleDropout(nn.Module):
    """A trained layer that skips itself at random, as LyCORIS' module dropout does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if torch.rand(1) > 0.1:  # the read
            return self.linear(x)
        return x


class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.layer = ModuleDropout()

    def forward(self, x):
        return self.layer(self.encoder(x)).sum()  # the call


def _line(marker: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    number = next(n for n, text in enumerate(lines, 1) if marker in text)
    return f"test_library_value_read_line.py:{number}"


def test_the_refusal_names_the_line_inside_the_module_that_read_the_value():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(Step(), (torch.randn(3, 4),), path="trace")
    message = str(caught.value)
    assert "reads the value of a tensor" in message
    assert f"{_line('# the read')}  if torch.rand(1) > 0.1:  # the read" in message
