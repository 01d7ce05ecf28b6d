"""A property test (hypothesis): over small random steps, the module-level path is never wrong.

Each step feeds a frozen encoder one of several inputs (the sample, the sample plus a torch /
numpy draw, a trainable adapter's output), may give it dropout, may mutate its output in place,
may loop over the batch in Python and draw after the call. Whatever the mix: the encoder's
call is cached exactly when its input is the sample alone and nothing else forbids it, and a
split that is made reproduces the step bit for bit (``verify``).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.calls import Verdict

WIDTH = 4
FEEDS = ("sample", "torch_draw", "numpy_draw", "trainable")


class RandomStep(nn.Module):
    def __init__(self, feed: str, dropout: bool, mutate: bool, loop: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(WIDTH, WIDTH)] + ([nn.Dropout(0.3)] if dropout else [])
        self.encoder = nn.Sequential(*layers).requires_grad_(False)
        self.adapter = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.feed, self.mutate, self.loop = feed, mutate, loop

    def forward(self, x, keep):
        if self.feed == "torch_draw":
            x = x + torch.randn_like(x)
        elif self.feed == "numpy_draw":
            x = x * float(np.random.rand() + 0.5)
        elif self.feed == "trainable":
            x = self.adapter(x)
        h = self.encoder(x)
        if self.mutate:
            h.mul_(2)
        if self.loop:
            h = torch.stack([row if k else torch.zeros_like(row) for row, k in zip(h, keep)])
        h = h * torch.rand_like(h)  # a draw after the call: stage 2 makes it
        return self.adapter(h).square().mean() + self.head(h).sum()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    feed=st.sampled_from(FEEDS),
    dropout=st.booleans(),
    mutate=st.booleans(),
    loop=st.booleans(),
    size=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_the_module_path_caches_only_what_it_proves_and_is_exact(
    feed, dropout, mutate, loop, size, seed
):
    step = RandomStep(feed, dropout, mutate, loop)
    generator = torch.Generator().manual_seed(seed)
    args = (torch.randn(size, WIDTH, generator=generator), [i % 2 == 0 for i in range(size)])
    # A fresh output the step writes in place is cached as returned; stage 2 writes a copy.
    should_cache = feed == "sample" and not dropout
    try:
        split = graphsplit.split(step, args, path="calls")
    except graphsplit.SplitError as error:
        assert not should_cache, str(error)
        assert "no frozen module call whose inputs are a function of the sample alone" in str(error)
        return
    assert should_cache
    assert [v.verdict for v in split.plan.verdicts] == [Verdict.CACHED]
    assert split.plan.verdicts[0].copied == (("out",) if mutate else ())
    assert all(c.ok for c in graphsplit.verify(step, split, args, seed=seed))
