"""A real tensor's method called with traced sizes is one node (issue 24, item 5).

A plain tensor attribute (neither parameter nor buffer) sized by the batch, as diffusers'
IP-Adapter and classifier-free-guidance steps write ``self.uncond_embeds.expand(bsz, -1, -1)``
with ``bsz = x.shape[0]``: torch's argument parser refuses a traced size among ``*size``
before any ``__torch_function__`` handler sees the call. The trace records the method as one
``call_method`` node on the tensor (a constant of the stage that uses it) with the size still
traced, so the stages follow the batch. Every model is split and verified bit for bit at batch
sizes 1, 2 and 3, and its stage 2 is run at another batch size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import batch, frozen, split_and_verify


class ExpandsByBatch(nn.Module):
    """The issue's step: unconditional embeddings expanded to the batch, added to frozen work."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.uncond_embeds = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(1))

    def forward(self, x):
        bsz = x.shape[0]
        u = self.uncond_embeds.expand(bsz, -1, -1)
        f = self.enc(x)[:, None, :] + u
        return self.head(f).mean()


class SizedByBatch(nn.Module):
    """One of a real tensor's sized methods, given the traced batch size (or a traced tensor)."""

    def __init__(self, sized) -> None:
        super().__init__()
        self.enc = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.table = torch.randn(1, 4, generator=torch.Generator().manual_seed(2))
        self.sized = sized

    def forward(self, x):
        hidden = self.enc(x)
        return self.head(hidden * self.sized(self.table, hidden)).mean()


SIZED = {
    "expand": lambda table, h: table.expand(h.shape[0], -1),
    "view": lambda table, h: table.repeat(h.shape[0], 1).view(h.shape[0], -1),
    "repeat": lambda table, h: table.repeat(h.shape[0], 1),
    "reshape": lambda table, h: table.expand(h.shape[0], 4).reshape(h.shape[0], 2, 2).flatten(1),
    "expand_as": lambda table, h: table.expand_as(h),
    "new_ones": lambda table, h: table.new_ones(h.shape[0], 4) * table,
    "new_zeros_tuple": lambda table, h: table.new_zeros((h.shape[0], 4)) + table,
    "tile": lambda table, h: table.tile((h.shape[0], 1)),
    "len": lambda table, h: table.expand(len(h), 4),
    "narrow": lambda table, h: table.expand(8, 4).narrow(0, 0, h.shape[0]),
    "new_full": lambda table, h: table.new_full((h.shape[0], 4), 0.5) * table,
}


def _stage2_follows_the_batch(split, model, size: int) -> None:
    other = batch(size, 4, seed=7)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_tensor_attribute_expanded_by_the_batch_size_splits_exactly(size):
    model = ExpandsByBatch()
    split = split_and_verify(model, (batch(size, 4),))
    # The attribute is a constant of stage 2, expanded by the batch size stage 2 reads off
    # its input: the boundary holds only the frozen encoder's per-sample output.
    assert "uncond_embeds.expand(" in split.stage2.code
    assert [spec.shape[1:] for spec in split.boundary.values()] == [(1, 4)]
    assert all(spec.batch_dim == 0 for spec in split.boundary.values())
    _stage2_follows_the_batch(split, model, 5)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(SIZED))
def test_a_real_tensors_method_given_traced_sizes_is_one_node(name, size):
    model = SizedByBatch(SIZED[name])
    split = split_and_verify(model, (batch(size, 4),))
    method = {"new_zeros_tuple": "new_zeros", "len": "expand"}.get(name, name)
    assert f".{method}(" in split.stage1.code  # frozen work on the constant: stage 1's
    _stage2_follows_the_batch(split, model, 4)


def test_a_real_tensors_method_given_real_sizes_runs_as_torchs():
    model = SizedByBatch(lambda table, h: table.expand(2, 4)[:1].expand(3, 4)[:1])
    split = split_and_verify(model, (batch(2, 4),))
    assert "expand" not in split.stage1.code + split.stage2.code  # folded: a constant
