"""Show a call's rows follow their samples without changing the batch's size.

The per-sample check of :func:`graphsplit.calls.analysis.judge` runs the batch's last sample
alone, at batch size 1. Many training scripts bind a size to ``args.train_batch_size``
(diffusers' LCM distillation builds ``uncond_prompt_embeds`` for it), and their step raises at
any other size. Then the step runs at the batch's own size ``B`` on *variants* of the example
batch, each naming, per row, the example's row it holds:

    ============== ===================== ==================================================
    variant        rows                  what a call that is not per sample shows there
    ============== ===================== ==================================================
    reversed       ``(B-1, ..., 1, 0)``  a call that depends on a sample's position
    last repeated  ``(B-1,) * B``        batch statistics (a mean, a BatchNorm in training
                                         mode): the batch is the last sample's alone
    first repeated ``(0,) * B``          the same for the first sample
    ============== ===================== ==================================================

A call with a batched input is per sample when, in every variant, the step makes it and each
output field's row ``j`` is, bit for bit, the example's row ``rows[j]``: the shapes are the
example's, so the kernels and their blocking are too, and a row that follows its sample
follows it exactly. A call whose input is not batched (stored once, as a constant) must see
the same inputs in every variant, else it is a per-sample loop's call. Random draws are no
concern here: a call judged so far has inputs equal under two seeds and draws nothing, and the
variants run under the first probe's seed. A call whose rows are not the batch's (a chunk of
it, a doubled classifier-free-guidance batch) has no batched input, or an output without the
batch first, and is refused before these checks.

What this cannot see: batch statistics that happen to be equal for the example and for each
sample repeated (a batch maximum both samples share), as the probe at batch size 1 cannot.
An example batch whose samples are all alike shows nothing: its calls are refused.

    reordered = probe_reordered(run, values, batch_size, alone_error)
    reordered.verdict(call, seen, batch_size) -> CallVerdict | None   # None: per sample
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphsplit.calls.module_calls import CallId
from graphsplit.calls.provenance import same_value
from graphsplit.calls.row_folds import rows_not_following
from graphsplit.calls.verdicts import CallVerdict, Verdict

Rows = slice | tuple[int, ...]
"""Which of the example's rows a batch holds: a slice (the last sample alone) or one index a
row."""


@dataclass(frozen=True)
class Variant:
    """A batch of the example's own size: ``rows[j]`` is the example's row at row ``j``."""

    name: str
    rows: tuple[int, ...]


def variants(batch_size: int) -> tuple[Variant, ...]:
    """The variants the step runs on (see the table above)."""
    last = batch_size - 1
    return (
        Variant("reversed", tuple(range(last, -1, -1))),
        Variant("its last sample repeated", (last,) * batch_size),
        Variant("its first sample repeated", (0,) * batch_size),
    )


def take(value: Any, batch_size: int, rows: Rows) -> Any:
    """``value`` (a step input) with its batch cut to ``rows``: a tensor with the batch first,
    a per-sample list or tuple (captions, drop flags), and what tuples (a webdataset's
    ``(image, text)``) and dicts (SDXL's ``added_cond_kwargs``) hold; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch_size:
        return value[rows if isinstance(rows, slice) else list(rows)]
    if type(value) in (list, tuple) and _holds_tensors(value):  # a webdataset (image, text)
        return type(value)(take(item, batch_size, rows) for item in value)
    if isinstance(value, list | tuple) and len(value) == batch_size:
        picked = value[rows] if isinstance(rows, slice) else [value[row] for row in rows]
        return list(picked) if isinstance(value, list) else tuple(picked)
    if type(value) is dict:
        return {key: take(item, batch_size, rows) for key, item in value.items()}
    return value


def _holds_tensors(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def _same(a: Any, b: Any) -> bool:
    """Whether two batches hold equal leaves (tensors bit for bit, other values by ``==``)."""
    left, left_spec = pytree.tree_flatten(a)
    right, right_spec = pytree.tree_flatten(b)
    if left_spec != right_spec:
        return False
    return all(x is y or same_value(x, y) for x, y in zip(left, right))


@dataclass
class Reordered:
    """The step's runs on the variants, or why they could not show anything."""

    alone_error: str
    """Why the step could not run the last sample alone (the reason these runs were made)."""
    runs: list[tuple[Variant, Any]] = field(default_factory=list)  # (variant, Probe)
    failed: str = ""
    """The step raised on a variant: ``"ValueError: ..."`` (no call is shown per sample)."""
    alike: bool = False
    """Every variant equals the example batch: its samples are all alike."""

    @property
    def probes(self) -> list[Any]:
        return [run for _, run in self.runs]

    def verdict(self, call: CallId, seen: Any, batched: bool) -> CallVerdict | None:
        """None when ``seen`` (the first probe's view of a call judged cached so far) is
        shown per sample; else the verdict that keeps it in stage 2."""
        kind = Verdict.MIXES_SAMPLES if batched else Verdict.NOT_PER_SAMPLE
        path, index = call
        if self.failed:
            return CallVerdict(
                path,
                index,
                kind,
                f"the step raised {self.alone_error} on the last sample alone, and "
                f"{self.failed} on the example's samples reordered at its own size, so "
                "nothing shows the call is per sample",
            )
        if self.alike:
            return CallVerdict(
                path,
                index,
                kind,
                "the step cannot run one sample alone and the example batch's samples are "
                "all alike, so reordering them shows nothing: split with distinct samples",
            )
        for variant, run in self.runs:
            other = run.calls.get(call)
            if other is None:
                return CallVerdict(
                    path, index, kind, f"the call is not made when the batch is {variant.name}"
                )
            if batched:
                differing = rows_not_following(seen.tensors, other.tensors, variant.rows)
                if differing:
                    return CallVerdict(
                        path,
                        index,
                        kind,
                        f"{differing}: its rows do not follow their samples when the batch is "
                        f"{variant.name} (rows {list(variant.rows)} of the example)",
                    )
            elif seen.inputs.difference(other.inputs) is not None:
                return CallVerdict(
                    path,
                    index,
                    kind,
                    "an unbatched input changes with the sample (a per-sample call): it "
                    f"differs when the batch is {variant.name}",
                )
        return None


def probe_reordered(
    run: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    values: dict[str, Any],
    batch_size: int,
    alone_error: BaseException,
    arguments: Callable[[dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]],
) -> Reordered:
    """Run the step (``run(args, kwargs) -> Probe``) on each variant of the example batch
    (``values``: the step's inputs by name; ``arguments`` makes ``(args, kwargs)`` of them)."""
    reordered = Reordered(f"{type(alone_error).__name__}: {alone_error}")
    batches = []
    for variant in variants(batch_size):
        cut = {name: take(value, batch_size, variant.rows) for name, value in values.items()}
        batches.append(cut)
        try:
            reordered.runs.append((variant, run(*arguments(cut))))
        except Exception as error:  # the step needs its samples in order: nothing is shown
            reordered.failed = f"{type(error).__name__}: {error}"
            reordered.runs.clear()
            return reordered
    reordered.alike = all(_same(cut, values) for cut in batches)
    return reordered
