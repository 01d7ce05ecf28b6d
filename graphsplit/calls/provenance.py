"""Whether a call's inputs are a function of the sample alone, from two runs of the step.

Autograd tracks most trainable dependence: an input tensor that requires grad was computed
from a trainable parameter. Not all of it: a value computed under ``torch.no_grad()`` or
detached carries no record, so the second run also moves the trainable parameters
(:mod:`.moved_weights`). Random draws, state outside the sample and those moved weights are
found by comparing each call's inputs between two runs of the step under different seeds
(torch, numpy and ``random``): an input that differs depends on something that is not the
sample; a third run, the first seed with the weights moved, tells which (:func:`~graphsplit.
calls.analysis.judge`). What the runs compare is :class:`CallInputs`, the call's flattened
arguments, tensors copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class CallInputs:
    """A call's arguments as leaves (tensors detached and copied) and their structure."""

    leaves: tuple[Any, ...]
    spec: Any

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInputs:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        copied = tuple(
            leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
        )
        return cls(copied, spec)

    def tensors(self) -> list[torch.Tensor]:
        return [leaf for leaf in self.leaves if isinstance(leaf, torch.Tensor)]

    def difference(self, other: CallInputs) -> str | None:
        """Where this call's inputs differ from ``other``'s (None: bit for bit the same)."""
        if self.spec != other.spec or len(self.leaves) != len(other.leaves):
            return "the arguments' structure differs"
        for index, (a, b) in enumerate(zip(self.leaves, other.leaves)):
            if not same_value(a, b):
                return f"argument leaf {index} differs"
        return None


def carries_grad(tensors: list[torch.Tensor]) -> bool:
    """Whether any input was computed from a trainable parameter (autograd's record)."""
    return any(t.requires_grad or t.grad_fn is not None for t in tensors)


def same_value(a: Any, b: Any) -> bool:
    """Whether two values are the same: tensors bit for bit with their shape, dtype and device,
    other values of one type by ``==``; never raises (an array's elementwise ``==``, an object
    without one: the same only if it is the same object)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and torch.equal(a, b)
        )
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # an object that cannot be compared is not the same
        return a is b
