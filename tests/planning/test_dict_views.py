"""Iterating a traced dict's views (planning/tracing/proxies.py: dict_view_items).

A module returning a dict of outputs (DINOv2's ``AllClassifiers``) is iterated by the step as
``for name, logits in outputs.items()``; the trace used to fall back to ``len`` and
``getitem(items, 0)``, which fails on a ``dict_items`` view.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import batch, split_and_verify


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return {"a": self.a(x), "b": self.b(x)}


class IteratesViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.heads = Heads()

    def forward(self, x):
        outputs = self.heads(torch.tanh(self.encoder(x)))
        loss = 0.0
        for name, logits in outputs.items():
            loss = loss + logits.pow(2).mean() * (2.0 if name == "a" else 1.0)
        for logits in outputs.values():
            loss = loss + logits.mean()
        for name in outputs.keys():  # noqa: SIM118 (the view, as the step writes it)
            loss = loss + outputs[name].sum()
        return loss


def test_items_values_and_keys_of_a_traced_dict_iterate_as_eager():
    model = IteratesViews()
    split = split_and_verify(model, (batch(3, 4),), path="trace")
    assert list(split.boundary) == ["tanh"]
    split_and_verify(model, (batch(5, 4),), path="trace")
