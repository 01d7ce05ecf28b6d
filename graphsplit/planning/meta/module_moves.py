"""A module the step moves to a device while it is analysed stays on ``meta``.

diffusers' Sana DreamBooth script moves its VAE inside the loop body,
``vae = vae.to(accelerator.device)`` (and back to the CPU with ``--offload``). The analysis
view (:mod:`graphsplit.planning.meta.analysis_view`) has given the VAE ``meta`` weights, so the
real ``Module.to`` tried to copy them to the CPU and failed ("Cannot copy out of meta tensor")
with a ``NotImplementedError`` the split did not expect. A move changes where the weights are,
not their values; the analysis decides the split without them. So while the view is active,
``to`` / ``cpu`` / ``cuda`` on a module holding ``meta`` tensors keep the device ``meta`` and
still apply a dtype (``vae.to(dtype=torch.float16)`` changes what the step computes).
Modules without ``meta`` tensors move as usual.

In: nothing. Out: a context manager, entered by ``analysis_view``:

    moves_stay_on_meta() -> ContextManager
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["moves_stay_on_meta"]


def _holds_meta(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return any(tensor.device.type == "meta" for tensor in tensors)


@contextlib.contextmanager
def moves_stay_on_meta() -> Iterator[None]:
    """Patch ``nn.Module.to`` / ``cpu`` / ``cuda`` for the analysis (see the module doc)."""
    to, cpu, cuda = nn.Module.to, nn.Module.cpu, nn.Module.cuda

    def moved_to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if not _holds_meta(self):
            return to(self, *args, **kwargs)
        _, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        options = {"dtype": dtype, "non_blocking": non_blocking, "memory_format": memory_format}
        return to(self, "meta", **{key: value for key, value in options.items() if value})

    def moved_cpu(self: nn.Module) -> nn.Module:
        return self if _holds_meta(self) else cpu(self)

    def moved_cuda(self: nn.Module, device: Any = None) -> nn.Module:
        return self if _holds_meta(self) else cuda(self, device)

    nn.Module.to, nn.Module.cpu, nn.Module.cuda = moved_to, moved_cpu, moved_cuda  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to, nn.Module.cpu, nn.Module.cuda = to, cpu, cuda  # type: ignore[method-assign]
