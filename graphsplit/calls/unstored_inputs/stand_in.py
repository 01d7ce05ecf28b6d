"""Stage 2's stand-in for an input the cache does not store (see the package's docstring).

An :class:`UnstoredInput` is a tensor on ``meta`` of the batch's shape and the input's dtype.
Every torch call that takes one runs on ``meta`` and gives stand-ins (``pixel_values.to(
weight_dtype)``, ``.shape``, a slice), so the step's own code runs as written up to the cached
call, which the cache answers without reading its arguments. Its ``.device`` is the device of
stage 2's batch (:func:`batch_device`: the one device of the batch's other tensors), carried
through the calls by :func:`~.ops.result_device`. A call that would hand the values on
(``.item()``, ``bool()``, a write in place into a real tensor, a random draw, a result the step
returns), or a ``.device`` read where that device is unknown, raises a
:class:`~graphsplit.SplitError` naming the input and the user's line: the probe saw no such
call on the example batch, so a later batch took another branch (or stage 2's batch is spread
over several devices), and nothing computed from a stand-in ever reaches the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from graphsplit.calls.unstored_inputs.ops import (
    on_meta,
    python_valued,
    reads_device,
    refusal,
    result_device,
)
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import frame_location, user_frame


class UnstoredInput(torch.Tensor):
    """A ``meta`` tensor standing for the step's input ``_graphsplit_input`` in stage 2, whose
    ``.device`` answers ``_graphsplit_device`` (None: unknown, a read raises)."""

    _graphsplit_input: str
    _graphsplit_device: torch.device | None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        stand_ins = [
            leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, UnstoredInput)
        ]
        name = stand_ins[0]._graphsplit_input if stand_ins else "?"
        if reads_device(func) and isinstance(args[0], UnstoredInput):
            if args[0]._graphsplit_device is None:
                raise _unknown_device_error(name)
            return args[0]._graphsplit_device
        why = refusal(func, kwargs)
        if why is not None:
            raise stand_in_error(name, why)
        try:
            result = on_meta(func, args, kwargs)
        except Exception as error:
            what = getattr(func, "__name__", repr(func))
            raise stand_in_error(
                name, f"runs {what}, which cannot run without the values ({error})"
            ) from None
        if python_valued(func, result):
            what = getattr(func, "__name__", repr(func))
            raise stand_in_error(name, f"hands its values to Python ({what})")
        device = result_device(func, args, kwargs, _device_of)
        return pytree.tree_map(
            lambda leaf: (
                stand_in_like(leaf, name, device) if isinstance(leaf, torch.Tensor) else leaf
            ),
            result,
        )


def _device_of(tensor: torch.Tensor) -> torch.device | None:
    if isinstance(tensor, UnstoredInput):
        return tensor._graphsplit_device
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.device


def stand_in(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
) -> UnstoredInput:
    """The stand-in for the input ``name`` of ``shape`` and ``dtype``, its ``.device``
    answering ``device`` (None: a read raises)."""
    return stand_in_like(torch.empty(shape, dtype=dtype, device="meta"), name, device)


def stand_in_like(tensor: torch.Tensor, name: str, device: torch.device | None) -> UnstoredInput:
    made = tensor.as_subclass(UnstoredInput)
    made._graphsplit_input = name
    made._graphsplit_device = device
    return made


def batch_device(batch: dict[str, Any], besides: str) -> torch.device | None:
    """The device stage 2's ``batch`` holds its tensors on, but for the key ``besides`` (the
    input's own shape rows): where the user moved the batch, and so where the unsplit step's
    batch, the input among it, would be. None where no other tensor or several devices."""
    devices = {
        value.device
        for key, value in batch.items()
        if key != besides and isinstance(value, torch.Tensor)
    }
    return devices.pop() if len(devices) == 1 else None


def _unknown_device_error(name: str) -> SplitError:
    """The refusal of a ``.device`` read stage 2 cannot answer for certain."""
    where, code = frame_location(user_frame())
    return user_error(  # type: ignore[return-value]
        SplitError,
        f"the step reads the .device of the input {name!r} (or of a value computed from it); "
        "the module-level plan does not store that input, and stage 2 answers with the one "
        "device its batch's other tensors are on, but they are on several devices (or none), "
        "or the value was moved to a device not named exactly (.cuda(), .to('cuda')) or "
        "computed with tensors on another device.",
        fix=Fix(
            "move every tensor of stage 2's batch to the training device, as the unsplit "
            "step's batch is moved (accelerate's prepared DataLoader does), and name the "
            "device with its index (torch.device('cuda', 0))"
        ),
        source=f"{where}  {code}" if code else where,
    )


def stand_in_error(name: str, why: str | None) -> SplitError:
    """The error a read of a stand-in's values raises: what the step did, where, and why
    (``why`` completes "a call that ...", or is None for the step's result)."""
    where, code = frame_location(user_frame())
    what = (
        f"passes a value computed from the input {name!r} to a call that {why}"
        if why
        else f"returns a value computed from the input {name!r}"
    )
    return user_error(  # type: ignore[return-value]
        SplitError,
        f"the step {what}; the module-level plan does not store that input (on the example "
        "batch only cached calls computed with it), so stage 2 holds a stand-in on meta in "
        "its place.",
        fix=Fix(
            "split with an example batch whose step uses this input as every later batch "
            "does (the same branches)"
        ),
        source=f"{where}  {code}" if code else where,
    )


def refuse_stand_ins(result: Any) -> None:
    """Raise when the step's result holds a stand-in (it computed a result from the input)."""
    for leaf in pytree.tree_leaves(result):
        if isinstance(leaf, UnstoredInput):
            raise stand_in_error(leaf._graphsplit_input, None)
