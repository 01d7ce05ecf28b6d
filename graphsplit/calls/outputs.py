"""Flatten a module call's output into named tensors, and rebuild it from them.

A frozen module returns a tensor, a tuple / list of them, a dict, or a transformers
``ModelOutput`` (an ordered dict whose ``[0]`` is its first field). :func:`flatten` names each
tensor by its path (``last_hidden_state``, ``1``, ``hidden_states__2``) and records the
structure; :func:`rebuild` makes the same structure back, so stage 2's code reads the cached
output as it read the live one. A Python number (``int``, ``float``, ``bool``: Wan's VAE encoder
returns its causal-conv index ``[27]`` beside its tensors) is kept in the structure as a
constant of the plan; stage 1 checks every sample's call returns the same
(:func:`constants_differ`), so a number that depends on the sample is refused, never cached
wrong. Anything else in an output (a string, an object) is no tensor the cache can hold:
:class:`NotATensor` names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphsplit.calls.field_reads import guard_class, guarded
from graphsplit.calls.model_outputs import build, is_model_output, maker

SINGLE = "out"
"""The field name of an output that is one tensor."""


class NotATensor(Exception):
    """An output leaf that is neither a tensor nor None: ``where`` (its path) and its type."""

    def __init__(self, where: str, value: Any) -> None:
        super().__init__(f"{where or SINGLE} is a {type(value).__name__}")
        self.where = where or SINGLE
        self.type_name = type(value).__name__


@dataclass(frozen=True)
class Structure:
    """How to rebuild one output: ``kind`` and, for containers, the keys and children."""

    kind: str  # "tensor" | "none" | "constant" (keys: the number) | "tuple" | "list" | "mapping"
    container: type | None = None
    keys: tuple[Any, ...] = ()
    children: tuple[Structure, ...] = ()
    left_out: tuple[str, ...] = ()  # a ModelOutput's fields the step does not read, not cached


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}__{key}" if prefix else str(key)


def flatten(value: Any, prefix: str = "") -> tuple[Structure, dict[str, torch.Tensor]]:
    """The output's structure and its tensors by field name (in order)."""
    if isinstance(value, torch.Tensor):
        return Structure("tensor"), {prefix or SINGLE: value}
    if value is None:
        return Structure("none"), {}
    if type(value) in NUMBERS:
        return Structure("constant", keys=(value,)), {}
    if isinstance(value, Mapping):
        keys = tuple(value.keys())
        children, tensors = [], {}
        for key in keys:
            child, found = flatten(value[key], _join(prefix, key))
            children.append(child)
            tensors.update(found)
        return Structure("mapping", type(value), keys, tuple(children)), tensors
    if isinstance(value, tuple | list) and not hasattr(value, "_fields"):
        children, tensors = [], {}
        for index, item in enumerate(value):
            child, found = flatten(item, _join(prefix, index))
            children.append(child)
            tensors.update(found)
        kind = "list" if isinstance(value, list) else "tuple"
        return Structure(kind, type(value), (), tuple(children)), tensors
    raise NotATensor(prefix, value)


NUMBERS = (int, float, bool)
"""The output leaves kept as constants of the plan (their exact types: no numpy scalar)."""


def holds_constant(structure: Structure) -> bool:
    """Whether the output holds a number kept as a constant of the plan."""
    return structure.kind == "constant" or any(map(holds_constant, structure.children))


def constants_differ(value: Any, structure: Structure) -> bool:
    """Whether the output ``value`` is not what ``structure`` rebuilds, other than its tensors
    (a number of the plan changed: another sample's call returned another number)."""
    try:
        if not structure.left_out:
            return flatten(value)[0] != structure
        pairs = zip(structure.keys, structure.children)
        return any(flatten(getattr(value, key), key)[0] != child for key, child in pairs)
    except NotATensor:
        return True


def tensors_of(value: Any, structure: Structure) -> dict[str, torch.Tensor]:
    """The tensors of ``value`` that ``structure`` holds (only its kept fields, when some of a
    ``ModelOutput``'s are left out)."""
    if not structure.left_out:
        return flatten(value)[1]
    tensors: dict[str, torch.Tensor] = {}
    for key in structure.keys:
        tensors.update(flatten(getattr(value, key), key)[1])
    return tensors


def rebuild(
    structure: Structure, tensors: Mapping[str, torch.Tensor], prefix: str = "", label: str = ""
) -> Any:
    """The output :func:`flatten` took apart, its tensors taken from ``tensors``; ``label``
    names the call in the error a left-out field's read raises."""
    if structure.kind == "tensor":
        return tensors[prefix or SINGLE]
    if structure.kind == "none":
        return None
    if structure.kind == "constant":
        return structure.keys[0]
    if structure.kind == "mapping":
        items = {
            key: rebuild(child, tensors, _join(prefix, key))
            for key, child in zip(structure.keys, structure.children)
        }
        container = structure.container or dict
        if not is_model_output(container):
            return container(items)
        made = build(container, items)
        if structure.left_out:
            made = guarded(made, structure.keys, structure.left_out, label)
        return made
    items = [
        rebuild(child, tensors, _join(prefix, index))
        for index, child in enumerate(structure.children)
    ]
    return items if structure.kind == "list" else tuple(items)


Answer = Callable[[Mapping[str, torch.Tensor]], Any]
"""``answer(cached)``: one cached call's output, rebuilt from a batch's boundary tensors."""


def answerer(structure: Structure, keys: Mapping[str, str], label: str) -> Answer:
    """``rebuild(structure, {field: cached[key] for field, key in keys.items()}, label=label)``
    as a function made once per cached call (stage 2 answers the call on every step).

    A lone tensor is read from the batch; a ``ModelOutput`` whose fields are tensors (or
    None) is filled by a :func:`~graphsplit.calls.model_outputs.maker` and given its guard
    class directly; any other structure goes through :func:`rebuild`.
    """
    if structure.kind == "tensor":
        key = keys[SINGLE]
        return lambda cached: cached[key]
    fast = _model_output_answer(structure, keys, label)
    if fast is not None:
        return fast
    pairs = tuple(keys.items())

    def answer(cached: Mapping[str, torch.Tensor]) -> Any:
        return rebuild(structure, {field: cached[key] for field, key in pairs}, label=label)

    return answer


def _model_output_answer(structure: Structure, keys: Mapping[str, str], label: str) -> Any:
    container = structure.container
    if structure.kind != "mapping" or container is None or not is_model_output(container):
        return None
    if any(child.kind not in ("tensor", "none") for child in structure.children):
        return None
    given = tuple(
        str(key) for key, child in zip(structure.keys, structure.children) if child.kind == "tensor"
    )
    if not given:
        return None
    boundary = tuple(keys[field] for field in given)
    make = maker(container, given)
    guard = (
        guard_class(container, structure.keys, structure.left_out, label)
        if structure.left_out
        else None
    )
    set_class = object.__setattr__  # what ``guarded`` does, its class found once
    if len(boundary) == 1:  # one field (a teacher's logits): no generator per step
        (key,) = boundary

        def answer_one(cached: Mapping[str, torch.Tensor]) -> Any:
            made = make[0]((cached[key],))
            if guard is not None:
                set_class(made, "__class__", guard)
            return made

        return answer_one

    def answer(cached: Mapping[str, torch.Tensor]) -> Any:
        made = make[0](tuple([cached[key] for key in boundary]))
        if guard is not None:
            set_class(made, "__class__", guard)
        return made

    return answer
