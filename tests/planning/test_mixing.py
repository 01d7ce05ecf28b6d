"""Frozen code that moves values along the batch dimension is never cached per sample."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import split_and_verify


class FrozenThen(nn.Module):
    """A frozen encoder, then ``op`` in frozen code, then a trainable head."""

    def __init__(self, op) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.op = op

    def forward(self, x):
        return self.head(self.op(self.encoder(x))).mean()


@pytest.mark.parametrize(
    ("op", "cached"),
    [
        (lambda h: torch.roll(h, 1, dims=0), False),
        (lambda h: h.flip(0), False),
        (lambda h: h.cumsum(0), False),
        (lambda h: h.softmax(0), False),
        (lambda h: h.sort(dim=0).values, False),
        (lambda h: h.softmax(-1), True),
        (lambda h: h.cumsum(1), True),
        (lambda h: h.flip(-1), True),
    ],
    ids=["roll-batch", "flip-batch", "cumsum-batch", "softmax-batch", "sort-batch",
         "softmax-features", "cumsum-features", "flip-features"],
)  # fmt: skip
def test_ops_along_the_batch_mix_samples_and_ops_along_features_do_not(op, cached):
    model = FrozenThen(op)
    split = split_and_verify(model, (torch.randn(3, 4),))
    # The value right before the head is cacheable only if the op keeps samples apart.
    last_frozen = next(n for n in split.graph.nodes if n.op == "call_module" and n.target == "head")
    before_head = last_frozen.args[0]
    assert (before_head.name in split.boundary) is cached
    if not cached:
        assert "moves values along the batch dimension" in split.cut.taint[before_head].reason
