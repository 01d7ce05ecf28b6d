"""Whether a call's inputs are a function of the sample alone, from two runs of the step.

Autograd tracks most trainable dependence: an input tensor that requires grad was computed
from a trainable parameter. Random draws and state outside the sample are found by comparing
each call's inputs between two runs of the step under different seeds (torch, numpy and
``random``): an input that differs depends on something that is not the sample. What the runs
compare is :class:`CallInputs`, the call's flattened arguments, tensors copied.

Autograd's record misses a value computed from a trainable parameter under ``torch.no_grad()``
or ``.detach()``: a policy's logits fed to a frozen reward model inside ``no_grad``, a frozen
teacher fed ``student.get_input_embeddings()(ids)``. Cached, such a call would be answered with
what the *old* weights gave once training moves them. So the second run also moves every
trainable floating-point parameter, as an optimizer step would (:func:`moved`): a frozen call
whose inputs then differ depends on the trainable weights or on a draw, and a third run (the
first seed, the weights moved) tells which (:func:`~graphsplit.calls.analysis.judge`).

    moved(params) -> context manager    # inside: each param's .data a moved copy

The move is deterministic (a generator of its own, seeded :data:`SEED`; the step's generators
are not touched), relative to each parameter's scale with a floor, so that a zero-initialised
LoRA ``B`` moves too. The parameters' own tensors are swapped back on exit (``param.data``, not
an in-place write): the values, storage, version counter and autograd flags the user sees after
the split are the ones from before, bit for bit. A value that depends on the weights only
through a choice the move leaves as it was (an argmax) is not seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn


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
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):  # a list of tensors: their == is elementwise
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[key], b[key]) for key in a)
    try:
        return bool(a == b)
    except Exception:  # an object that cannot be compared is not the same
        return a is b


SEED = 20_240_917
RELATIVE = 0.05
"""The move's standard deviation, relative to the parameter's root mean square."""
FLOOR = 0.01
"""The move's standard deviation where the parameter is all zeros (a fresh LoRA ``B``)."""
MOVED = "each trainable floating-point parameter plus noise of 5% of its scale, put back after"
"""The move, in words, for messages."""


@contextlib.contextmanager
def moved(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Inside, every movable parameter of ``params`` holds a moved copy of its values."""
    generator_by_device: dict[torch.device, torch.Generator] = {}
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for param in params:
                if not _movable(param):
                    continue
                device = param.device
                if device not in generator_by_device:
                    generator_by_device[device] = torch.Generator(device).manual_seed(SEED)
                original = param.data
                saved.append((param, original))
                param.data = _moved(original, generator_by_device[device])
        yield
    finally:
        for param, original in reversed(saved):
            param.data = original


def _movable(param: nn.Parameter) -> bool:
    # A DTensor or other subclass holds a shard: moving it is the wrapper's business.
    data = param.data
    return type(data) is torch.Tensor and data.is_floating_point() and data.device.type != "meta"


def _moved(original: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    values = original.float()
    scale = values.square().mean().sqrt().item() * RELATIVE if values.numel() else 0.0
    noise = torch.randn(values.shape, generator=generator, device=values.device)
    return (values + noise * (scale or FLOOR)).to(original.dtype)
