"""Run the step with its trainable parameters moved, to find values that depend on them.

Autograd's record (:func:`~graphsplit.calls.provenance.carries_grad`) misses a value computed
from a trainable parameter under ``torch.no_grad()`` or ``.detach()``: a policy's logits fed
to a frozen reward model inside ``no_grad``, a frozen teacher fed
``student.get_input_embeddings()(ids)``. Cached, such a call would be answered with what the
*old* weights gave once training moves them. So one probe runs with every trainable
floating-point parameter moved, as an optimizer step would move it: a frozen call whose inputs
then differ depends on the trainable weights (or on a draw, which a third run, same seed and
moved weights, tells apart: :mod:`graphsplit.calls.call_split`).

    moved(params) -> context manager    # inside: each param's .data a moved copy

The move is deterministic (a generator of its own, seeded :data:`SEED`; the step's generators
are not touched), relative to each parameter's scale with a floor, so that a zero-initialised
LoRA ``B`` moves too. The parameters' own tensors are swapped back on exit (``param.data``, not
an in-place write): the values, storage, version counter and autograd flags the user sees after
the split are the ones from before, bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

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
