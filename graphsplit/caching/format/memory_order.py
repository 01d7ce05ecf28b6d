"""Memory order: the layout in memory of a tensor that is dense but not plain contiguous.

Glossary:
    memory order: a tensor's dims from outermost to innermost in memory, recorded when it is
        not plain contiguous (a channels-last VAE output, a transposed embedding). The cache
        stores rows in memory order and reads them back with the same strides, because stage 2
        must see the layout stage 1 produced: ``randn_like`` fills memory in that order, and
        kernels pick their algorithm by it.
    row order: the memory order of one sample's row, the batch dim left out.

In and out::

    memory_order(tensor) -> Order | None          # None: plain contiguous (or not dense)
    row_order(order, batch_dim) -> Order
    inverse(order) -> Order                       # undoes tensor.permute(order)
"""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

__all__ = ["Order", "inverse", "memory_order", "row_order"]

Order = tuple[int, ...]  # a memory order; None where plain contiguous


def memory_order(tensor: torch.Tensor) -> Order | None:
    """``tensor``'s dims from outermost to innermost in memory; None if plain contiguous.

    A tensor that is not dense but does not overlap itself (a strided view such as
    ``DiagonalGaussianDistribution.mode()``, a chunk of a channels-last tensor) has the order of
    its strides: torch lays out what it derives from it in that order (elementwise results of a
    channels-last chunk are channels-last), so the cache stores it densely in that order. None
    for an expanded tensor (a stride 0): torch lays out what it derives from it contiguously.
    Size-1 dims go before the first larger dim that follows them, so a batch of one has the
    order of a full batch; their strides still count where torch reads a contiguous 4-d or
    5-d tensor as channels-last by them (``suggest_memory_format``), which is then its order.

    Example:
        >>> memory_order(torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last))
        (0, 2, 3, 1)
    """
    if tensor.is_contiguous():
        # Contiguous, yet with size-1 dims whose strides make torch read it as channels-last
        # (Swin's NHWC features permuted to (B, C, 1, 1)): a convolution then computes in
        # that layout, and rows stacked plainly would make it compute in another.
        return _channels_last_order(tensor)
    sized = sorted(
        (d for d in range(tensor.dim()) if tensor.shape[d] != 1),
        key=lambda d: (-tensor.stride(d), d),
    )
    if any(tensor.stride(d) == 0 for d in sized):
        return None  # expanded: not dense, and what derives from it is contiguous
    ones = [d for d in range(tensor.dim()) if tensor.shape[d] == 1]
    order: list[int] = []
    for d in sized:
        order += [one for one in ones if one < d and one not in order]
        order.append(d)
    order += [one for one in ones if one not in order]
    return None if order == sorted(order) else tuple(order)


def _channels_last_order(tensor: torch.Tensor) -> Order | None:
    """The channels-last order of a 4-d / 5-d tensor torch's kernels treat as channels-last,
    else None (``suggest_memory_format``: what a convolution picks its layout by)."""
    if tensor.dim() not in (4, 5) or suggest_memory_format(tensor) is torch.contiguous_format:
        return None
    return (0, *range(2, tensor.dim()), 1)


def row_order(order: Order, batch_dim: int) -> Order:
    """The memory order of one row: ``order`` without the batch dim, renumbered."""
    return tuple(d - (d > batch_dim) for d in order if d != batch_dim)


def inverse(order: Order) -> Order:
    """The permutation that undoes ``tensor.permute(order)``."""
    result = [0] * len(order)
    for position, d in enumerate(order):
        result[d] = position
    return tuple(result)
