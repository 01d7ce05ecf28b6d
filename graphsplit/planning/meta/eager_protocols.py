"""What eager code does to tensors that a meta analysis must answer differently, and how.

Glossary:
    device move: ``x.to("cpu")``, ``x.to(pipe.device)``, ``x.cuda()``, ``x.cpu()``. The step
        runs them for real in its stages; the analysis runs every op on fake ``meta`` tensors,
        where a move to a real device would leave the analysis (a fake ``cpu`` tensor meets
        ``meta`` weights) or fail outright (``.cuda()`` on a machine without CUDA). Here a move
        stays on ``meta`` and keeps its dtype change, if any.
    0-dim index: ``sigmas[timestep_id]`` with ``timestep_id`` a 0-dim integer tensor. Eager
        torch reads the index's value (``.item()``) and selects that row; a fake tensor has no
        value. Only the shape matters here, and every row has the same shape, so the analysis
        selects row 0. The graph keeps the ``getitem`` node as written: stages index by value.
    value method: ``x.tolist()``, ``x.numpy()``. Unlike ``.item()`` they read values in Python,
        past the ATen ops the meta run types its failures at, and on meta fail with a plain
        ``RuntimeError`` about storage. Here they raise the typed value read
        (:class:`~graphsplit.planning.meta.meta_failures.TensorMethodValueRead`), so the step
        is refused (or the code around them retried) as for ``.item()``.

    inference mode in a meta run: a frozen leaf whose own ``forward`` enters
        ``torch.inference_mode()`` (DINOv2's linear evaluation wraps its backbone so). On fake
        tensors, inference mode makes views of the analysis's stand-in parameters fail
        ("Cannot set version_counter for inference tensor") and outputs whose ``_version``
        the analysis cannot read. While a fake mode runs, ``inference_mode`` is entered as
        ``no_grad``: the same values and shapes, no autograd, which is all the analysis asks;
        stage code, on real tensors, enters the real inference mode as the step does.

In: nothing, and for the inference mode the planning's patcher. Out: a context manager,
entered inside :func:`~graphsplit.planning.meta.analysis_view.meta_execution` wherever the
analysis runs a node, and the inference mode's replacement, registered once per planning:

    eager_protocols_on_meta() -> ContextManager
    inference_mode_as_no_grad_on_meta(patcher) -> None
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from graphsplit.planning.meta.meta_failures import TensorMethodValueRead
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.rules.user_lines import current_line

_META = torch.device("meta")
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})
_VALUE_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}


def _is_device(value: Any) -> bool:
    """A device argument of ``Tensor.to``: a ``torch.device``, a device string, a CUDA index."""
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return False
        return True
    return isinstance(value, int) and not isinstance(value, bool)


def _move_onto_meta(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``Tensor.to``'s arguments with every device (or a tensor's device) replaced by meta."""
    tensor, *rest = args
    moved: list[Any] = []
    for position, value in enumerate(rest):
        if position == 0 and isinstance(value, torch.Tensor):  # x.to(other): its dtype, here
            moved.append(value.dtype)
        elif position == 0 and _is_device(value):
            moved.append(_META)
        else:
            moved.append(value)
    if "device" in kwargs:
        kwargs = {**kwargs, "device": _META}
    return (tensor, *moved), kwargs


def _zero_dim_as_int(index: Any) -> Any:
    """``index`` with each 0-dim integer tensor replaced by row 0 (same shape, no value read)."""
    if isinstance(index, tuple):
        return tuple(_zero_dim_as_int(item) for item in index)
    if (
        isinstance(index, torch.Tensor)
        and index.dim() == 0
        and not index.dtype.is_floating_point
        and not index.dtype.is_complex
        and index.dtype is not torch.bool
    ):
        return 0
    return index


class _EagerProtocolsOnMeta(TorchFunctionMode):
    """Device moves stay on meta; 0-dim integer indices select by shape; value methods are
    typed value reads (see the glossary)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            args, kwargs = _move_onto_meta(args, kwargs)
        elif func is torch.Tensor.cuda or func is torch.Tensor.cpu:
            non_blocking = bool(kwargs.get("non_blocking", False))
            return args[0].to(_META, non_blocking=non_blocking)
        elif func in _INDEXING:
            args = (args[0], _zero_dim_as_int(args[1]), *args[2:])
        elif func in _VALUE_METHODS and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            raise TensorMethodValueRead(_VALUE_METHODS[func], current_line())
        return func(*args, **kwargs)


@contextlib.contextmanager
def eager_protocols_on_meta() -> Iterator[None]:
    """Run device moves and 0-dim tensor indexing the way the meta analysis needs them."""
    with _EagerProtocolsOnMeta():
        yield


_FAKE = torch._C._TorchDispatchModeKey.FAKE
_GRAD_BEFORE = "_graphsplit_grad_before"  # on the inference_mode object, while entered on meta


def inference_mode_as_no_grad_on_meta(patcher: Patcher) -> None:
    """Enter ``torch.inference_mode`` (a ``with`` block or a decorator) as ``no_grad`` while a
    fake mode runs, as itself otherwise, until ``patcher`` exits (see the glossary)."""
    inference_mode = torch.autograd.grad_mode.inference_mode
    enter, leave = inference_mode.__enter__, inference_mode.__exit__

    def entered(self: Any) -> None:
        if not self.mode or torch._C._get_dispatch_mode(_FAKE) is None:
            return enter(self)
        setattr(self, _GRAD_BEFORE, torch.is_grad_enabled())
        torch._C._set_grad_enabled(False)
        return None

    def left(self: Any, *exc_info: Any) -> None:
        before = self.__dict__.pop(_GRAD_BEFORE, None)
        if before is None:
            return leave(self, *exc_info)
        torch._C._set_grad_enabled(before)
        return None

    patcher.patch_method(inference_mode, "__enter__", entered)
    patcher.patch_method(inference_mode, "__exit__", left)
