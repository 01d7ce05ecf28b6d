"""The boundary's dtypes under an ambient autocast, read from one real run of stage 1.

The analysis runs every op on fake tensors backed by ``meta``, and ``torch.autocast`` acts only
on tensors of its own device type (the AutocastCPU / AutocastCUDA dispatch keys). Under an
autocast around ``graphsplit.split`` (the caller's ``with accelerator.autocast():``, as
docs/howto.md asks for a frozen module inside a model the script prepares), the analysis
records a frozen Linear's output as float32 where the real run makes bfloat16. The boundary's
dtypes become the cache header's: a float32 header would store the bfloat16 rows upcast, and
stage 2, fed float32 where the unsplit step had bfloat16, would run its ops that autocast
leaves alone (an add, a residual, a layer norm's input) in float32: another loss. So where an
autocast is on, stage 1 runs once on the example batch (no autograd, the model's buffers put
back after) and each boundary tensor takes the dtype that run gave it. Without an ambient
autocast nothing runs: the analysis's dtypes are the real ones.

The step's Python may also have read such a dtype while it was traced (peft's LoRA layer keeps
``torch_result_dtype = result.dtype`` of its base layer's output and casts its sum back to it):
the trace then holds the analysis's dtype as a constant (``.to(torch.float32)`` where the run
has bfloat16), and stage 2 computes in other dtypes than eager, with gradients a rounding
apart. Where a boundary tensor whose dtype the step read comes out of the real run in another
dtype, the trace is refused (``path="auto"`` then takes the module-level path, which runs the
step's own code under the autocast). A dtype read of a tensor stage 1 does not output is not
checked: nothing real computes it before training.

In and out::

    with_run_dtypes(boundary, stage1, model, args, kwargs)  # api.py, once a plan is generated
    refuse_read_dtypes(cut, boundary)      # TraceError: a dtype the trace baked is not the run's
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from graphsplit.artifacts import BoundarySpec, Cut
from graphsplit.errors import Fix, TraceError, user_error
from graphsplit.planning.patching.module_state import buffers_put_back
from graphsplit.planning.rules.grad_modes import current_modes
from graphsplit.planning.rules.taint import facts
from graphsplit.planning.tracing.proxies import DTYPE_READ

__all__ = ["READ_DTYPE_FIX", "refuse_read_dtypes", "with_run_dtypes"]

READ_DTYPE_FIX = Fix(
    'split with path="calls" (path="auto" takes it after this refusal), whose stage 2 runs '
    "the step's own code under the autocast; or put the autocast inside the step's forward "
    "(accelerator.prepare(model) does, for the model it wraps)"
)


def with_run_dtypes(
    boundary: dict[str, BoundarySpec],
    stage1: nn.Module,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, BoundarySpec]:
    """``boundary`` with the dtypes stage 1 gives its tensors under the ambient autocast
    (``boundary`` itself where no autocast is on, or where the example or the weights are on
    ``meta`` and nothing can run: that split cannot cache, and its dtypes are the analysis's)."""
    if not current_modes().autocast or _on_meta(model, (args, kwargs)):
        return boundary
    with buffers_put_back(model), torch.no_grad():
        outputs = stage1(*args, **kwargs)
    specs = dict(boundary)
    for name, spec in boundary.items():
        value = outputs.get(name) if isinstance(outputs, dict) else None
        if isinstance(value, torch.Tensor) and value.dtype != spec.dtype:
            per_sample = spec.bytes_per_sample * value.element_size() // spec.dtype.itemsize
            specs[name] = dataclasses.replace(spec, dtype=value.dtype, bytes_per_sample=per_sample)
    return specs


def _on_meta(model: nn.Module, example: Any) -> bool:
    leaves = [leaf for leaf in tree_leaves(example) if isinstance(leaf, torch.Tensor)]
    tensors = [*leaves, *model.parameters(), *model.buffers()]
    return any(tensor.device.type == "meta" for tensor in tensors)


def refuse_read_dtypes(cut: Cut, boundary: dict[str, BoundarySpec]) -> None:
    """Raise :class:`~graphsplit.TraceError` where the step read the dtype of a boundary tensor
    that the real run under the ambient autocast makes in another dtype than the analysis."""
    for node in cut.boundary:
        if not node.meta.get(DTYPE_READ) or node.name not in boundary:
            continue
        planned, run = facts(node).dtype, boundary[node.name].dtype
        if planned != run:
            raise user_error(
                TraceError,
                f"The step reads the dtype of a tensor the autocast around graphsplit.split "
                f"makes in {run}, where graphsplit's analysis, which cannot apply an autocast, "
                f"computed {planned}: the trace holds {planned} as a constant there, and stage "
                "2 would compute in other dtypes than the step does.",
                node=node,
                fix=READ_DTYPE_FIX,
            )
