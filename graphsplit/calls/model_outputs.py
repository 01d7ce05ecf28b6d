"""Make a transformers ``ModelOutput`` back from its fields, as its constructor would, faster.

Stage 2 answers a cached call that returned a ``ModelOutput`` (``CausalLMOutputWithPast``)
with a new one on every step. Its constructor (the dataclass ``__init__`` through
``ModelOutput.__setattr__``, then ``__post_init__``'s checks) costs about 8 µs, 0.7% of a tiny
distillation step. :func:`build` fills the same object directly: every field an attribute
(None when not given), the given ones also its items, in field order. That is what the
constructor makes whenever the first field is a tensor or another field is given; in its
other branch (a first field that is a dict or an iterable of pairs) :func:`build` calls the
constructor. The first build of each class is also made by the constructor and compared,
item by item and attribute by attribute; a class whose result differs is always constructed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

_CHECKED: dict[type, tuple[str, ...] | None] = {}
"""Per class: its field names when :func:`build` matched the constructor, None when not."""


@functools.cache
def is_model_output(container: type) -> bool:
    """Whether ``container`` is a transformers ``ModelOutput`` (without importing it)."""
    return any(base.__name__ == "ModelOutput" for base in container.__mro__)


def build(container: type, items: dict[str, Any]) -> Any:
    """``container(**items)``: a ``ModelOutput`` holding ``items`` (field name -> value)."""
    if container not in _CHECKED:
        _CHECKED[container] = _check(container, items)
    names = _CHECKED[container]
    if names is None or not _plain_branch(names, items):
        return container(**items)
    return _filled(container, names, items)


def maker(container: type, given: tuple[str, ...]) -> list[Callable[[tuple[Any, ...]], Any]]:
    """A one-item list whose function makes ``build(container, dict(zip(given, values)))``
    for tensor ``values`` (stage 2 makes one per cached call, once: the fields it gives never
    change; the caller calls ``made[0](values)``, so that the function can be swapped).

    The first call goes through :func:`build` (checked against the constructor as always);
    when that check passed, the item becomes a filler that skips :func:`build`'s per-call
    lookups: the attributes from a template of every field set to None, then the given
    fields, attribute and item, in field order (what :func:`_filled` does).
    """
    made: list[Callable[[tuple[Any, ...]], Any]] = []

    def first(values: tuple[Any, ...]) -> Any:
        output = build(container, dict(zip(given, values)))
        names = _CHECKED.get(container)
        if names is not None and given and all(name in names for name in given):
            made[0] = _filler(container, names, given)
        else:
            made[0] = lambda values: build(container, dict(zip(given, values)))
        return output

    made.append(first)
    return made


def _filler(
    container: type, names: tuple[str, ...], given: tuple[str, ...]
) -> Callable[[tuple[Any, ...]], Any]:
    template = dict.fromkeys(names)
    ordered = tuple(sorted(range(len(given)), key=lambda index: names.index(given[index])))
    fields = tuple((given[index], index) for index in ordered)
    new, setitem = container.__new__, OrderedDict.__setitem__

    def fill(values: tuple[Any, ...]) -> Any:
        made = new(container)
        attributes = made.__dict__
        attributes.update(template)
        for name, index in fields:
            value = values[index]
            attributes[name] = value
            setitem(made, name, value)
        return made

    return fill


def _plain_branch(names: tuple[str, ...], items: dict[str, Any]) -> bool:
    """Whether ``__post_init__`` only copies the given fields into the items (its usual path)."""
    if not names or any(name not in names for name in items):
        return False
    first = items.get(names[0])
    if isinstance(first, torch.Tensor):
        return True
    return first is None and any(items.get(name) is not None for name in names[1:])


def _filled(container: type, names: tuple[str, ...], items: dict[str, Any]) -> Any:
    made = container.__new__(container)
    attributes = made.__dict__
    for name in names:
        value = items.get(name)
        attributes[name] = value
        if value is not None:
            OrderedDict.__setitem__(made, name, value)
    return made


def _check(container: type, items: dict[str, Any]) -> tuple[str, ...] | None:
    try:
        names = tuple(field.name for field in dataclasses.fields(container))
    except TypeError:  # not a dataclass: only its constructor knows how to make it
        return None
    if not _plain_branch(names, items):
        return None
    made, want = _filled(container, names, items), container(**items)
    same_items = list(made.keys()) == list(want.keys()) and all(
        made[key] is want[key] for key in want
    )
    same_attributes = made.__dict__.keys() == want.__dict__.keys() and all(
        made.__dict__[key] is want.__dict__[key] for key in want.__dict__
    )
    return names if type(made) is type(want) and same_items and same_attributes else None
