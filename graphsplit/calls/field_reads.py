"""Which fields of a frozen call's output the step reads, and stage 2's stand-ins for the
fields the cache does not hold.

**A ModelOutput read by name.** A teacher called as trainers call it (``teacher(**inputs)``,
labels included, ``use_cache`` on) returns fields the cache cannot hold per sample (a scalar
``loss``, a ``DynamicCache``) beside the ``logits`` the step reads. During the probe,
:func:`watch` swaps the output's class for a subclass that records each access: an attribute or
a string key that names a field is a read of that field; anything else (``[0]``, iteration,
``len``, ``in``, ``==``, ``repr``, a method such as ``to_tuple`` / ``values`` / ``get``) reads
the output as a whole. Stage 2 then answers with :func:`guarded`: the same class, holding the
cached fields, whose every other access raises a :class:`~graphsplit.SplitError` (so a batch
whose step reads a field the plan left out fails loudly instead of reading None).

**A field stage 2 never computes with.** A cached call's output may hold fields stage 2 never
computes with (a ``CLIPTextModel`` called with ``output_hidden_states=True`` whose step reads
``hidden_states[-2]`` and ``text_embeds`` only). Such a field is not stored; stage 2 rebuilds
the output with an :class:`Unstored` tensor in its place, so the output's structure reads as
before (``len(out.hidden_states)``, ``out.hidden_states[-2]``).

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

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import frame_location, user_frame

# Names that are not the output's values: looked up by ``dataclasses.fields`` and isinstance.
_METADATA = frozenset({"__class__", "__dataclass_fields__", "__dataclass_params__"})


@dataclass
class Reads:
    """What the step read of one output: fields by name, and the first whole-output access."""

    fields: set[str] = field(default_factory=set)
    whole: str | None = None

    def merge(self, other: Reads) -> None:
        self.fields |= other.fields
        self.whole = self.whole or other.whole


_WATCHED: dict[int, Reads] = {}
_TRACKING: dict[type, type] = {}
_GUARDS: dict[tuple[Any, ...], type] = {}

_WHOLE_SLOTS = {
    "__iter__": "iteration",
    "__len__": "len()",
    "__contains__": "`in`",
    "__eq__": "==",
    "__ne__": "!=",
    "__repr__": "repr()",
    "__reduce_ex__": "pickling / copying",
    "__reversed__": "reversed()",
    "__or__": "|",
}


def field_names(container: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(container))


def watch(output: Any, reads: Reads) -> Any:
    """Record the step's reads of ``output`` in ``reads``; returns the class to restore."""
    original = type(output)
    if original not in _TRACKING:
        _TRACKING[original] = _subclass(original, _tracking_namespace(original))
    _WATCHED[id(output)] = reads
    output.__class__ = _TRACKING[original]
    return original


def unwatch(output: Any, original: type) -> None:
    _WATCHED.pop(id(output), None)
    output.__class__ = original


def _subclass(base: type, namespace: dict[str, Any]) -> type:
    namespace["__module__"] = base.__module__
    namespace["__qualname__"] = base.__qualname__
    return type(base)(base.__name__, (base,), namespace)


def _tracking_namespace(base: type) -> dict[str, Any]:
    names = field_names(base)

    def getattribute(self: Any, name: str) -> Any:
        reads = _WATCHED.get(id(self))
        if reads is not None and name not in _METADATA:
            if name in names:
                reads.fields.add(name)
            elif reads.whole is None:
                reads.whole = f".{name}"
        return base.__getattribute__(self, name)

    def getitem(self: Any, key: Any) -> Any:
        reads = _WATCHED.pop(id(self), None)  # the base's own reads are not the step's
        try:
            if reads is not None:
                if isinstance(key, str) and key in names:
                    reads.fields.add(key)
                elif reads.whole is None:
                    reads.whole = f"[{key!r}]"
            return base.__getitem__(self, key)
        finally:
            if reads is not None:
                _WATCHED[id(self)] = reads

    namespace: dict[str, Any] = {"__getattribute__": getattribute, "__getitem__": getitem}
    for slot, what in _WHOLE_SLOTS.items():
        namespace[slot] = _whole_slot(base, slot, what)
    return namespace


def _whole_slot(base: type, slot: str, what: str) -> Any:
    method = getattr(base, slot)

    def whole(self: Any, *args: Any, **kwargs: Any) -> Any:
        reads = _WATCHED.pop(id(self), None)
        try:
            if reads is not None and reads.whole is None:
                reads.whole = what
            return method(self, *args, **kwargs)
        finally:
            if reads is not None:
                _WATCHED[id(self)] = reads

    return whole


def guarded(output: Any, kept: tuple[str, ...], left_out: tuple[str, ...], label: str) -> Any:
    """``output`` (built with the ``kept`` fields) as a stand-in whose other reads raise."""
    # ``object.__setattr__``, not ``output.__class__ = ...``: ``ModelOutput.__setattr__`` looks
    # up the dataclass fields on every call to find that ``__class__`` is none of them.
    object.__setattr__(output, "__class__", guard_class(type(output), kept, left_out, label))
    return output


def guard_class(base: type, kept: tuple[str, ...], left_out: tuple[str, ...], label: str) -> type:
    """The class :func:`guarded` gives an output of class ``base`` (made once per key)."""
    key = (base, kept, left_out, label)
    if key not in _GUARDS:
        _GUARDS[key] = _subclass(base, _guard_namespace(base, frozenset(kept), left_out, label))
    return _GUARDS[key]


def _guard_namespace(
    base: type, kept: frozenset[str], left_out: tuple[str, ...], label: str
) -> dict[str, Any]:
    names = field_names(base)

    def refuse(what: str) -> SplitError:
        return user_error(
            SplitError,
            f"the step reads {what} of {label}'s output; the module-level plan caches only "
            f"{sorted(kept)} of it (the example batch's step read no more) and left out "
            f"{list(left_out)}.",
            fix=Fix(
                "split with an example batch whose step reads the same fields of this output, "
                "by name (out.logits or out['logits'])"
            ),
        )

    def getattribute(self: Any, name: str) -> Any:
        if name in _METADATA or (name in names and name not in left_out):
            return base.__getattribute__(self, name)
        raise refuse(f".{name}")

    def getitem(self: Any, key: Any) -> Any:
        if isinstance(key, str) and key in names and key not in left_out:
            return base.__getattribute__(self, key)
        raise refuse(f"[{key!r}]")

    def describe(self: Any) -> str:
        return f"{base.__name__}(cached {sorted(kept)}, left out {list(left_out)})"

    namespace: dict[str, Any] = {
        "__getattribute__": getattribute,
        "__getitem__": getitem,
        "__repr__": describe,
    }
    for slot, what in _WHOLE_SLOTS.items():
        if slot != "__repr__":

            def whole(self: Any, *args: Any, _what: str = what, **kwargs: Any) -> Any:
                raise refuse(_what)

            namespace[slot] = whole
    return namespace


# -- fields not stored: a guarded meta stand-in ----------------------------------------------
FREE, SHAPE, VALUE = "free", "shape", "value"

_FREE_PROPERTIES = frozenset({"dtype", "ndim", "layout", "is_sparse", "is_quantized"})
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
