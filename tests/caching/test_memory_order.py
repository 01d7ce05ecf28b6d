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


def test_a_contiguous_tensor_torch_reads_as_channels_last_keeps_that_order():
    """Swin's last NHWC feature map permuted to (B, C, 1, 1) is contiguous, but its size-1
    dims' strides make a convolution compute channels-last; rows stacked plainly would make it
    compute contiguous, and its weight gradients differ in the last bits."""
    permuted = torch.randn(2, 1, 1, 64).permute(0, 3, 1, 2)
    assert permuted.is_contiguous()
    assert memory_order(permuted) == (0, 2, 3, 1)
    plain = torch.stack(list(permuted.unbind(0)))  # what stacking the rows gives
    # the cache's read: a fresh buffer in that memory order, the rows copied in
    restored = torch.empty(2, 1, 1, 64).permute(0, 3, 1, 2).copy_(plain)
    conv = torch.nn.Conv2d(64, 32, 1)
    assert conv(restored).stride() == conv(permuted).stride() != conv(plain).stride()
    assert memory_order(plain) is None and memory_order(torch.randn(2, 64, 1, 1)) is None
    assert memory_order(torch.randn(2, 1, 1, 1, 8).permute(0, 4, 1, 2, 3)) == (0, 2, 3, 4, 1)
