"""One split's analyses share the op memo's and call memo's tables (planning/meta/shared_memos):
a new shape signature's plan answers what the first plan ran with the same metadata, and makes
the plan a split of that batch alone makes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.planning.meta import call_memo


class TextAndSizeBranch(nn.Module):
    """A frozen text encoder of repeated blocks (same tokens in every batch) and an image path
    whose width steers Python: a width not a multiple of 16 needs a plan of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.text = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).requires_grad_(False)
        self.encoder = nn.Conv2d(3, 8, 3, padding=1).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, tokens, pixels, target):
        text = self.text(tokens).mean(1)
        h = self.encoder(pixels)
        if h.shape[-1] % 16 != 0:
            h = F.pad(h, (0, 1))
        pooled = h.mean((-1, -2)) + text
        return F.mse_loss(self.head(pooled), target)


def _batch(width: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randn(2, 5, 8, generator=generator),
        "pixels": torch.randn(2, 3, 8, width, generator=generator),
        "target": torch.randn(2, 1, generator=generator),
    }


def _misses_while(function) -> int:
    """Op memo misses (ops run by the fake mode) of the analyses ``function`` runs."""
    memos: list[call_memo.CallMemo] = []
    made = call_memo.CallMemo.__init__

    def counted(self, op_memo):
        made(self, op_memo)
        memos.append(self)

    call_memo.CallMemo.__init__ = counted
    try:
        function()
    finally:
        call_memo.CallMemo.__init__ = made
    return sum(memo.op_memo.misses for memo in memos)


def _facts_and_code(plan) -> tuple:
    facts = [(n.name, n.meta.get("facts"), n.meta.get("op_record")) for n in plan.graph.nodes]
    return facts, plan.stage1.code, plan.stage2.code, dict(plan.boundary)


def test_a_new_signatures_plan_reads_the_first_plans_memos_and_is_the_same_plan():
    step, first, other = TextAndSizeBranch(), _batch(16, 0), _batch(12, 1)
    split = graphsplit.split(step, kwargs=first)
    shared = _misses_while(lambda: split.stage1(**other))  # makes the second plan
    assert len(split.plans) == 2
    alone: list[graphsplit.Split] = []
    own = _misses_while(lambda: alone.append(graphsplit.split(step, kwargs=other)))
    assert shared < own  # the text encoder's ops at the same shapes are answered
    assert _facts_and_code(split.plans[1]) == _facts_and_code(alone[0].plans[0])
    batch = split.stage1(**other)
    torch.manual_seed(3)
    loss = split.stage2(**batch)
    torch.manual_seed(3)
    assert torch.equal(loss, step(**other))


def test_every_split_starts_with_empty_tables():
    step, first = TextAndSizeBranch(), _batch(16, 0)
    graphsplit.split(step, kwargs=first)
    again: list[graphsplit.Split] = []
    warm = _misses_while(lambda: again.append(graphsplit.split(step, kwargs=first)))
    fresh = _misses_while(lambda: graphsplit.split(step, kwargs=first))
    assert warm == fresh > 0  # the earlier splits' tables are not read
