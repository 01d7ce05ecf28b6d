"""Which fields of a frozen call's ``ModelOutput`` the step reads, and a stand-in that holds
only those.

A teacher called as trainers call it (``teacher(**inputs)``, labels included, ``use_cache``
on) returns fields the cache cannot hold per sample (a scalar ``loss``, a ``DynamicCache``)
beside the ``logits`` the step reads. During the probe, :func:`watch` swaps the output's class
for a subclass that records each access: an attribute or a string key that names a field is a
read of that field; anything else (``[0]``, iteration, ``len``, ``in``, ``==``, ``repr``, a
method such as ``to_tuple`` / ``values`` / ``get``) reads the output as a whole. Stage 2 then
answers with :func:`guarded`: the same class, holding the cached fields, whose every other
access raises a :class:`~graphsplit.SplitError` (so a batch whose step reads a field the plan
left out fails loudly instead of reading None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from graphsplit.errors import Fix, SplitError, user_error

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
