"""``graphsplit.verify``: prove on real data that the two stages train exactly like the model.

Runs ``model(*args)`` and ``stage2(**stage1(*args))`` from the same seed of every generator a
step draws from (torch, numpy's global generator, Python's ``random``, and ``torch.Generator``
objects of the step's own, seeded as calls are handed them), backpropagates through both, and
compares every output tensor and the gradient of every trainable parameter. Gradients already
stored on the parameters, and every generator's state, are restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from graphsplit.api import Split
from graphsplit.calls import CallSplit
from graphsplit.calls.generators import seeded
from graphsplit.errors import Fix, VerifyError, user_error
from graphsplit.planning.step.callables import as_step_module

# A mismatch is either a step that is not repeatable bit for bit, or a split that is wrong.
MISMATCH_FIX = Fix(
    "if the step itself differs from run to run (nondeterministic kernels), compare with a "
    "tolerance (verify(..., rtol=..., atol=...)); otherwise do not train with this split, and "
    "please report the step"
)


@dataclass(frozen=True)
class Comparison:
    """One compared tensor: an output leaf or a parameter's gradient."""

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    ok: bool

    def row(self) -> str:
        status = "ok" if self.ok else "MISMATCH"
        return f"  {self.name:<60} {self.shape!s:<20} {self.max_abs_diff:<12.3g} {status}"


def verify(
    model: nn.Module | Callable[..., Any],
    split: Split | CallSplit,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> list[Comparison]:
    """Check that ``split`` reproduces ``model`` on this batch: outputs and gradients.

    With the default ``rtol=atol=0`` the check is bit for bit. ``model`` is what was split: a
    module, or a function / bound method (its modules are found as :func:`graphsplit.split`
    finds them, and module arguments are left out of the batch stage 1 is given).

    Returns:
        one :class:`Comparison` per output tensor and trainable parameter.

    Raises:
        VerifyError: with a per-tensor table of the differences.

    Example:
        >>> import torch, graphsplit
        >>> step = torch.nn.Sequential(torch.nn.Linear(4, 4).requires_grad_(False),
        ...                            torch.nn.Linear(4, 1))
        >>> x = torch.randn(2, 4)
        >>> comparisons = graphsplit.verify(step, graphsplit.split(step, (x,)), (x,))
        >>> all(c.ok for c in comparisons)
        True
    """
    step = as_step_module(model, args, dict(kwargs or {}))
    model, args, kwargs = step.module, step.args, step.kwargs
    params = [
        (name, param)
        for name, param in model.named_parameters()
        if name in split.trainable and param.requires_grad
    ]
    saved = [param.grad for _, param in params]
    try:
        out_model, grads_model = _run(lambda: model(*args, **kwargs), params, seed)
        out_split, grads_split = _run(
            lambda: split.stage2(**_as_cached(split.stage1(*args, **kwargs))), params, seed
        )
    finally:
        for (_, param), grad in zip(params, saved):
            param.grad = grad
    comparisons = _compare_outputs(out_model, out_split, rtol, atol)
    comparisons += [
        _compare(f"grad {name}", grads_model[name], grads_split[name], rtol, atol)
        for name, _ in params
    ]
    if not all(comparison.ok for comparison in comparisons):
        header = f"  {'tensor':<60} {'shape':<20} {'max |diff|':<12} status"
        table = "\n".join([header] + [c.row() for c in comparisons])
        raise user_error(
            VerifyError,
            f"The split stages do not reproduce {type(model).__name__} "
            f"(seed={seed}, rtol={rtol}, atol={atol}):\n{table}",
            fix=MISMATCH_FIX,
        )
    return comparisons


def _as_cached(boundary: Any) -> Any:
    """Stage 1's outputs as the cache hands them to stage 2: detached. A gradient that reached
    a trainable parameter only through stage 1's own autograd graph would be lost from a cache
    (a value cached that should not be), and verify must see that too."""
    if not isinstance(boundary, dict):
        return boundary
    return {
        key: value.detach() if isinstance(value, torch.Tensor) else value
        for key, value in boundary.items()
    }


def _run(
    step: Callable[[], Any], params: list[tuple[str, nn.Parameter]], seed: int
) -> tuple[Any, dict[str, torch.Tensor | None]]:
    for _, param in params:
        param.grad = None
    # torch, numpy and random (SpecAugment-style masks draw with np.random), and the step's own
    # torch.Generator objects, all from ``seed``; every state is given back afterwards.
    with seeded(seed):
        out = step()
        differentiable = [
            leaf
            for leaf in pytree.tree_leaves(out)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        if differentiable:
            torch.stack([leaf.float().sum() for leaf in differentiable]).sum().backward()
    grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in params}
    return out, grads


def _compare_outputs(expected: Any, actual: Any, rtol: float, atol: float) -> list[Comparison]:
    leaves_expected, spec_expected = pytree.tree_flatten(expected)
    leaves_actual, spec_actual = pytree.tree_flatten(actual)
    if spec_expected != spec_actual:
        raise user_error(
            VerifyError,
            "The split returns a different structure than the model:\n"
            f"  model: {spec_expected}\n  split: {spec_actual}",
            fix=MISMATCH_FIX,
        )
    comparisons = []
    for index, (a, b) in enumerate(zip(leaves_expected, leaves_actual)):
        name = f"output[{index}]"
        if isinstance(a, torch.Tensor):
            comparisons.append(_compare(name, a, b, rtol, atol))
        else:
            comparisons.append(Comparison(name, (), 0.0 if a == b else float("inf"), a == b))
    return comparisons


def _compare(
    name: str, a: torch.Tensor | None, b: torch.Tensor | None, rtol: float, atol: float
) -> Comparison:
    if a is None or b is None:
        ok = a is None and b is None
        return Comparison(name, (), 0.0 if ok else float("inf"), ok)
    if a.shape != b.shape or a.dtype != b.dtype:
        return Comparison(name, tuple(a.shape), float("inf"), False)
    a, b = a.detach(), b.detach()
    diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if rtol == 0.0 and atol == 0.0:
        ok = torch.equal(a, b)
    else:
        ok = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return Comparison(name, tuple(a.shape), diff, ok)
