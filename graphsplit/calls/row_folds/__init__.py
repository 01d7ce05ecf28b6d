"""Calls that take k rows a sample: a clip's frames, an image pair, chosen and rejected.

Video and preference steps fold a per-sample axis onto the batch before a frozen call:
SVD-Xtend and AnimateDiff encode ``rearrange(pixel_values, "b f c h w -> (b f) c h w")``,
the Diffusion-DPO script encodes ``torch.cat(pixel_values.chunk(2, dim=1))``. The call's rows
are the batch's samples ``k`` at a time, in one of two orders:

    ========== ================================ ======================================
    order      rows of sample ``i`` (batch B)   made by
    ========== ================================ ======================================
    grouped    ``i*k .. i*k + k-1``             ``(b f)``: ``reshape``, ``flatten(0, 1)``
    strided    ``i, B+i, .., (k-1)*B + i``      ``torch.cat`` of k per-sample tensors
    ========== ================================ ======================================

Such a call is per sample when its output rows follow their samples in one of the orders,
shown as the per-sample check shows any call (:func:`graphsplit.calls.analysis.judge`): the
rows of the batch's last sample are what that sample gives alone, or, for a step that runs at
its own batch size only, every reordered batch (:mod:`graphsplit.calls.reordered`) moves the
rows, bit for bit, as the order says. An example whose samples make both orders look right
(alike samples) shows nothing, and the call stays in stage 2.

A folded call's outputs are stored ``[B, k, ...]`` (one ``[k, ...]`` entry a sample, so the
cache's format is the same) and unfolded to the call's ``[k*B, ...]`` in stage 2 by the same
``reshape`` in reverse: a copy of the values, bit for bit.

    candidates(inputs, outputs, batch_size) -> [RowFold, RowFold] or []
    shown(folds, seen, batch_size, alone, reordered) -> (RowFold | None, why)
    RowFold.fold(tensor) / RowFold.unfold(tensor) / RowFold.rows(samples, batch_size)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphsplit.batch_invariance import rows_alike

__all__ = ["RowFold", "candidates", "rows_not_following", "shown"]


@dataclass(frozen=True)
class RowFold:
    """``k`` rows a sample, ``strided`` (``torch.cat`` of k tensors) or grouped (``(b f)``)."""

    k: int
    strided: bool

    @property
    def order(self) -> str:
        return "strided, torch.cat's order" if self.strided else "grouped, a (b f) reshape's"

    def describe(self) -> str:
        return f"{self.k} rows a sample, {self.order}"

    def rows(self, samples: tuple[int, ...], batch_size: int) -> list[int]:
        """The call's row indices holding ``samples`` (one a batch row), in the call's order."""
        if self.strided:
            return [j * batch_size + i for j in range(self.k) for i in samples]
        return [i * self.k + j for i in samples for j in range(self.k)]

    def fold(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[k*B, ...]`` -> ``[B, k, ...]``: a sample's rows as one cache entry. A view: the
        cache records its memory order (:mod:`graphsplit.caching.format.memory_order`), so
        :meth:`unfold` gives stage 2 the call's own strides (a channels-last VAE output stays
        channels-last, and ``randn_like`` of it draws as in the unsplit step)."""
        if self.strided:
            return tensor.unflatten(0, (self.k, -1)).transpose(0, 1)
        return tensor.unflatten(0, (-1, self.k))

    def unfold(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[B, k, ...]`` -> ``[k*B, ...]``, the call's own rows (a view where the batch
        holds :meth:`fold`'s strides)."""
        if self.strided:
            return tensor.transpose(0, 1).flatten(0, 1)
        return tensor.flatten(0, 1)


def candidates(
    inputs: list[torch.Tensor], outputs: dict[str, torch.Tensor], batch_size: int
) -> list[RowFold]:
    """Both orders of ``k`` rows a sample, where every input tensor with rows has ``k * B``
    of them (k >= 2, none has ``B``), one of them rows of a dim of their own (a per-sample
    loop's call on ``x[i]`` of ``[B, W]`` has W rows of one number each), and so does every
    output field; else none."""
    if batch_size < 2 or not outputs:
        return []
    firsts = {int(t.shape[0]) for t in inputs if t.dim() >= 1}
    if len(firsts) != 1 or not any(t.dim() >= 2 for t in inputs):
        return []
    (rows,) = firsts
    if rows <= batch_size or rows % batch_size:
        return []
    if any(t.dim() < 1 or t.shape[0] != rows for t in outputs.values()):
        return []
    k = rows // batch_size
    return [RowFold(k, strided=False), RowFold(k, strided=True)]


def shown(
    folds: list[RowFold],
    seen: Any,
    batch_size: int,
    alone: Any | None,
    reordered: Any | None,
) -> tuple[RowFold | None, str]:
    """The one order the probes show ``seen``'s rows follow (``alone``: the last sample's run
    of the call, None where the step ran no such call alone; ``reordered``: the
    :class:`~graphsplit.calls.reordered.Reordered` runs, where the step cannot run one sample
    alone), or None and why not ("" where the last sample alone gives the call other than
    ``k`` rows: its rows do not come k a sample, and the call is judged as any other)."""
    k = folds[0].k
    if alone is not None and any(t.shape[0] != k for t in alone.inputs.tensors() if t.dim()):
        return None, ""
    if reordered is not None:
        if reordered.failed or reordered.alike or not reordered.runs:
            return None, (
                f"its {k * batch_size} rows ({k} a sample) could not be shown to follow their "
                f"samples: the step cannot run one sample alone and its samples reordered "
                f"{'raised ' + reordered.failed if reordered.failed else 'show nothing'}"
            )
        matching = [fold for fold in folds if _follows_reordered(fold, seen, reordered, batch_size)]
    elif alone is None:
        return None, "the call is not made when the last sample runs alone"
    else:
        matching = [fold for fold in folds if _follows_alone(fold, seen, alone, batch_size)]
    if len(matching) == 1:
        return matching[0], ""
    if matching:
        return None, (
            f"its {k * batch_size} rows ({k} a sample) follow their samples in either order on "
            "this example (its samples are alike): split with distinct samples"
        )
    return None, (
        f"its {k * batch_size} rows ({k} a sample) follow their samples in neither a grouped "
        "(b f) nor a torch.cat order"
    )


def _follows_alone(fold: RowFold, seen: Any, alone: Any, batch_size: int) -> bool:
    rows = fold.rows((batch_size - 1,), batch_size)
    return not rows_not_following(seen.tensors, alone.tensors, rows, exact=False)


def _follows_reordered(fold: RowFold, seen: Any, reordered: Any, batch_size: int) -> bool:
    return all(
        seen.call in run.calls
        and not rows_not_following(
            seen.tensors, run.calls[seen.call].tensors, fold.rows(variant.rows, batch_size)
        )
        for variant, run in reordered.runs
    )


def rows_not_following(
    example: dict[str, torch.Tensor],
    other: dict[str, torch.Tensor],
    rows: Sequence[int],
    *,
    exact: bool = True,
) -> str:
    """The output fields whose ``other`` run's rows are not the example's ``rows``: bit for
    bit where the shapes are the example's (a reordered batch), within the alone tolerances
    (``exact=False``) for another run's batch size (the last sample alone)."""
    differing = []
    for name, tensor in example.items():
        theirs = other.get(name)
        expected = tensor.detach()[list(rows)]
        if (
            theirs is None
            or theirs.shape != expected.shape
            or theirs.dtype != expected.dtype
            or not _alike(theirs.detach(), expected, exact)
        ):
            differing.append(name)
    return ", ".join(differing)


def _alike(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    return bool(torch.equal(a, b)) if exact else rows_alike(a, b)
