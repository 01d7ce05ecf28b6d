"""How far a row computed alone may be from its row of a batch and still be the same sample's.

A CPU kernel computes a batch's rows with another blocking of the same sums than a row alone:
the last bits move, nothing crosses samples. A call that mixes samples (padding to the batch's
longest, batch statistics) moves its values at their own scale. Both planning paths ask this
when they check a call per sample: the module-level path's last sample run alone
(:mod:`graphsplit.calls.row_folds`), and the whole-step trace's opaque calls run sample by
sample (:mod:`graphsplit.planning.opaque.example_run`). Every other frozen op the trace caches
is computed in the cache's batches unchecked: the same last bits.

In and out::

    alone_tolerances(expected) -> (rtol, atol)
    rows_alike(alone, expected) -> bool
"""

from __future__ import annotations

import torch

__all__ = ["ALONE_ATOL", "ALONE_RTOL", "HALF_STEPS", "alone_tolerances", "rows_alike"]

# A float32 row alone against its row of the batch.
ALONE_RTOL = 1e-4
ALONE_ATOL = 1e-5

# In a half-precision output (bfloat16: 8 bits of mantissa) another blocking of the same sums
# moves the last bit of the output's largest values: ALONE_RTOL is below one step there. Two
# steps of the dtype, relative to each value and to the field's largest, stay far below what
# mixing samples does (a change at the values' scale).
HALF_STEPS = 2


def alone_tolerances(expected: torch.Tensor) -> tuple[float, float]:
    """``(rtol, atol)`` for a row computed alone against its row of the batch."""
    if not expected.is_floating_point():
        return ALONE_RTOL, ALONE_ATOL
    step = torch.finfo(expected.dtype).eps
    if step * HALF_STEPS <= ALONE_RTOL:  # float32, float64
        return ALONE_RTOL, ALONE_ATOL
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return step * HALF_STEPS, max(ALONE_ATOL, step * HALF_STEPS * scale)


def rows_alike(alone: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``alone`` is ``expected`` up to the last bits a batched kernel moves: equal
    shapes and dtypes, integers and booleans bit for bit."""
    if alone.shape != expected.shape or alone.dtype != expected.dtype:
        return False
    if not expected.is_floating_point():
        return bool(torch.equal(alone, expected))
    rtol, atol = alone_tolerances(expected)
    return bool(torch.allclose(alone.double(), expected.double(), rtol=rtol, atol=atol))
