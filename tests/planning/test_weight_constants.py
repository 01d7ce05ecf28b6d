"""A tensor the step computes from weights it reached through ``parameters()`` is refused.

Such a loop hands the trace the weights themselves (``meta`` twins under the analysis view),
so what the step computes from them happened while tracing and fx stored it as a constant:
before, stage 2 held a ``meta`` constant and failed only when run, with a message about
loading real weights (planning/tracing/weight_constants.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.helpers import frozen, split_and_verify


class L2RegularisedHead(nn.Module):
    """A frozen encoder, a trained head, and the head's weights' squared norm added to the loss
    by a loop over ``parameters()``: the usual hand-written weight decay."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(8, 6))
        self.head = nn.Linear(6, 1)

    def forward(self, x, y):
        loss = F.mse_loss(self.head(self.encoder(x)), y)
        penalty = sum(p.pow(2).sum() for p in self.head.parameters())
        return loss + 1e-2 * penalty  # the penalty's line


def _batch(size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)


def _line(marker: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    number = next(n for n, text in enumerate(lines, 1) if marker in text)
    return f"test_weight_constants.py:{number}"


def test_the_trace_refuses_a_penalty_computed_from_parameters_naming_the_line():
    torch.manual_seed(0)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(L2RegularisedHead(), _batch(), path="trace")
    message = str(caught.value)
    assert "named_parameters() or parameters()" in message
    assert "depends on trainable parameters" in message
    assert _line("# the penalty's line") in message
    assert 'path="calls"' in caught.value.fix.words


def test_the_auto_path_takes_the_module_level_path_which_computes_it_live():
    torch.manual_seed(0)
    step = L2RegularisedHead()
    split = split_and_verify(step, _batch())
    assert split.path == "calls"
    assert "named_parameters() or parameters()" in split.reason
    assert "encoder__0__out" in " ".join(split.boundary)
    # A cache made before an optimizer step still trains exactly: the penalty is live.
    boundary = split.stage1(*_batch(seed=1))
    with torch.no_grad():
        step.head.weight.add_(0.5)
    expected = step(*_batch(seed=1))
    assert torch.equal(split.stage2(**boundary), expected)


class UnreadPenalty(L2RegularisedHead):
    """The same penalty put in a metric the loss does not read: a traced node reads the
    constant, and nothing the output depends on reads that node."""

    def forward(self, x, y):
        loss = F.mse_loss(self.head(self.encoder(x)), y)
        penalty = sum(p.pow(2).sum() for p in self.head.parameters())
        self.logged = loss.detach() + penalty  # a metric, never returned
        return loss


def test_a_penalty_only_dead_code_reads_is_left_alone():
    torch.manual_seed(0)
    split = split_and_verify(UnreadPenalty(), _batch(), path="trace")
    assert split.path == "trace"
    assert any(n.op == "get_attr" and "constant" in str(n.target) for n in split.graph.nodes)
