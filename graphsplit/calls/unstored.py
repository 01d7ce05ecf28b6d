"""Output fields the cache does not store, and stage 2's stand-in for each: a guarded ``meta``
tensor.

A cached call's output may hold fields stage 2 never computes with (a ``CLIPTextModel``
called with ``output_hidden_states=True`` whose step reads ``hidden_states[-2]`` and
``text_embeds`` only). Such a field is not stored; stage 2 rebuilds the output with an
:class:`Unstored` tensor in its place, so the output's structure reads as before
(``len(out.hidden_states)``, ``out.hidden_states[-2]``).

What the step may do with a field without its values is one table, :func:`read_kind`, used
both by the probe (:mod:`.usage`, which decides what is stored) and by :class:`Unstored`
(which allows exactly that in stage 2):

    FREE   the dtype, the rank, the kind of number: the same on a ``meta`` tensor of the
           probe's dtype and rank (``.dtype``, ``.ndim``, ``.dim()``, ``.is_floating_point()``)
    SHAPE  the shape (``.shape``, ``.size()``, ``.numel()``, ``len()``): its shape is stored
           per sample (a few int64s) and the stand-in has it
    VALUE  anything else (arithmetic, ``.device``, ``.stride()``, ``repr``): the field is stored

A torch call on an :class:`Unstored` tensor beyond what it allows raises a
:class:`~graphsplit.SplitError` naming the call, the field and the user's line, never
computes on ``meta``.
"""

from __future__ import annotations

from typing import Any

import torch

from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import frame_location, user_frame

FREE, SHAPE, VALUE = "free", "shape", "value"

_FREE_PROPERTIES = frozenset({"dtype", "ndim", "layout", "is_cuda", "is_sparse", "is_quantized"})
_FREE_METHODS = frozenset(
    {"dim", "ndimension", "element_size", "is_floating_point", "is_complex", "is_signed"}
)
_SHAPE_PROPERTIES = frozenset({"shape"})
_SHAPE_METHODS = frozenset({"size", "numel", "nelement", "__len__"})


def read_kind(func: Any) -> str:
    """What a torch call ``func`` reads of the tensors it takes: FREE, SHAPE or VALUE."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: func is its descriptor's __get__
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if prop in _FREE_PROPERTIES:
            return FREE
        return SHAPE if prop in _SHAPE_PROPERTIES else VALUE
    if name in _FREE_METHODS:
        return FREE
    return SHAPE if name in _SHAPE_METHODS else VALUE


def _described(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":
        return "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    return f"{name}()"


class Unstored(torch.Tensor):
    """A ``meta`` tensor standing for an output field the cache does not store.

    ``_graphsplit_where`` names the call and field; ``_graphsplit_shaped`` says whether its
    shape is the batch's own (stored per sample) or only the probe's (then shape reads raise).
    """

    _graphsplit_where: str
    _graphsplit_shaped: bool

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = read_kind(func)
        placeholders = [arg for arg in _flat(args, kwargs) if isinstance(arg, Unstored)]
        refused = [
            p for p in placeholders if kind == VALUE or (kind == SHAPE and not p._graphsplit_shaped)
        ]
        if refused:
            raise _error(refused[0], func, kind)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _flat(args: Any, kwargs: Any) -> list[Any]:
    return torch.utils._pytree.tree_leaves((args, kwargs or {}))


def _error(placeholder: Unstored, func: Any, kind: str) -> SplitError:
    what = "the shape" if kind == SHAPE else "the values"
    where, code = frame_location(user_frame())
    return user_error(  # type: ignore[return-value]
        SplitError,
        f"the step reads {what} of {placeholder._graphsplit_where} ({_described(func)}), "
        "which the module-level plan does not store: the example batch's step never read it, "
        "so stage 2 holds a placeholder on meta in its place.",
        fix=Fix(
            "split with an example batch whose step reads the same fields of this call's "
            "output (take the same branches as every later batch)"
        ),
        source=f"{where}  {code}" if code else where,
    )


def unstored(shape: tuple[int, ...], dtype: torch.dtype, where: str, *, shaped: bool) -> Unstored:
    """A stand-in of ``shape`` and ``dtype`` for the field ``where`` (``"text_encoder call 0:
    hidden_states__1"``); ``shaped``: its shape is the batch's own, so shape reads are allowed."""
    made = torch.empty(shape, dtype=dtype, device="meta").as_subclass(Unstored)
    made._graphsplit_where = where
    made._graphsplit_shaped = shaped
    return made
