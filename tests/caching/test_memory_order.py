"""Memory order: recording a tensor's layout in memory."""

from __future__ import annotations

import torch

from graphsplit.caching.format.memory_order import memory_order


def test_memory_order_of_common_layouts():
    channels_last = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    assert memory_order(channels_last) == (0, 2, 3, 1)
    assert memory_order(channels_last[:1]) == (0, 2, 3, 1)
    assert memory_order(torch.randn(3, 2, 5).transpose(0, 1)) == (1, 0, 2)
    assert memory_order(torch.randn(3, 4)) is None
    assert memory_order(torch.randn(3, 1).expand(3, 4)) is None  # not dense: read as contiguous
    assert memory_order(torch.randn(4, 6)[:, ::2]) is None
    # a chunk of a channels-last tensor (a VAE's latent_dist.mode()) keeps its strides' order
    chunk = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)[:, :4]
    assert memory_order(chunk) == (0, 2, 3, 1) == memory_order(chunk * 2)
