"""Stage 2's stand-in for an input the cache does not store (see the package's docstring).

An :class:`UnstoredInput` is a tensor on ``meta`` of the batch's shape and the input's dtype.
Every torch call that takes one runs on ``meta`` and gives stand-ins (``pixel_values.to(
weight_dtype)``, ``.shape``, a slice), so the step's own code runs as written up to the cached
call, which the cache answers without reading its arguments. A call that would hand the values
on (``.item()``, ``bool()``, ``.device``, a write in place into a real tensor, a random draw,
a result the step returns) raises a :class:`~graphsplit.SplitError` naming the input and the
user's line: the probe saw no such call on the example batch, so a later batch took another
branch, and nothing computed from a stand-in ever reaches the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from graphsplit.calls.unstored_inputs.ops import on_meta, python_valued, refusal
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import frame_location, user_frame


class UnstoredInput(torch.Tensor):
    """A ``meta`` tensor standing for the step's input ``_graphsplit_input`` in stage 2."""

    _graphsplit_input: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        stand_ins = [
            leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, UnstoredInput)
        ]
        name = stand_ins[0]._graphsplit_input if stand_ins else "?"
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
        return pytree.tree_map(
            lambda leaf: stand_in_like(leaf, name) if isinstance(leaf, torch.Tensor) else leaf,
            result,
        )


def stand_in(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> UnstoredInput:
    """The stand-in for the input ``name`` of ``shape`` and ``dtype``."""
    return stand_in_like(torch.empty(shape, dtype=dtype, device="meta"), name)


def stand_in_like(tensor: torch.Tensor, name: str) -> UnstoredInput:
    made = tensor.as_subclass(UnstoredInput)
    made._graphsplit_input = name
    return made


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
