"""A plan's shape signature, read off its stage code, and the example a plan was made from.

A plan is made for one example batch. Where the traced code turned a size or a value read from
frozen data into a Python constant, the plan's stages hold a check of it
(:func:`graphsplit.runtime.check_size`, ``check_size_read``, ``check_value``); the values those
checks expect are the plan's *signature*. Sizes that merely flow through torch ops are not
checked and are no part of it: one plan serves every value of them.

Glossary:
    signature: ``{what: expected value}`` for every check a plan's two stages hold, ``what``
        written as the user wrote it (``((video.shape[2] - 1) // 4) + 1``); empty for a plan
        without size checks. A size stage 2 reads off a cached tensor
        (:func:`graphsplit.runtime.check_same_read`) expects ``{"read off": that tensor's
        read}``: no value, but which read stage 2 makes is the plan's.
    signature key: a short digest of the signature's canonical JSON: what a cache records per
        sample and what a batch carries to stage 2 (:data:`SIGNATURE_KEY`).
    example record: the shapes, dtypes and plain values of the example batch a plan was made
        from, as JSON; a process that never saw a raw batch of a signature rebuilds its plan from
        it (zeros of those shapes: a value read from frozen data cannot be rebuilt so).

In and out::

    signature_of(stage1, stage2) -> Signature
    Signature.key -> "3f0c9a1e27b4d655"; Signature.to_json() / Signature.from_json(text)
    example_record(args, kwargs) -> str | None;  example_from_record(text) -> (args, kwargs)
"""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphsplit.runtime import check_same_read, check_size, check_size_read, check_value

__all__ = [
    "SIGNATURE_KEY",
    "Signature",
    "example_from_record",
    "example_record",
    "signature_of",
]

# The entry of a stage-1 output dict, and of a collated cache batch, that names its plan.
SIGNATURE_KEY = "graphsplit_signature"


@dataclass(frozen=True)
class Signature:
    """``values``: ``(what, expected value as JSON text)`` per check, sorted; ``lines`` maps
    each ``what`` to the user's line that read it; ``reads_values``: whether a value read from
    frozen data is part of it (stage 2 cannot recheck those: the batch must name its plan)."""

    values: tuple[tuple[str, str], ...]
    lines: tuple[tuple[str, str], ...] = ()
    reads_values: bool = False

    @property
    def key(self) -> str:
        """A short digest of :meth:`to_json`: equal signatures, equal keys."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return {what: json.loads(value) for what, value in self.values}

    def to_json(self) -> str:
        return json.dumps(
            {"values": dict(self.values), "reads_values": self.reads_values}, sort_keys=True
        )

    @classmethod
    def from_json(cls, text: str, lines: tuple[tuple[str, str], ...] = ()) -> Signature:
        data = json.loads(text)
        values = tuple(sorted((str(k), str(v)) for k, v in data["values"].items()))
        return cls(values, lines, bool(data["reads_values"]))

    def __str__(self) -> str:
        if not self.values:
            return "(no size checks)"
        return ", ".join(f"{what} = {value}" for what, value in self.values)


def signature_of(stage1: fx.GraphModule, stage2: fx.GraphModule) -> Signature:
    """The values a plan's stage checks expect (see the module glossary)."""
    values: dict[str, list[str]] = {}
    lines: dict[str, str] = {}
    reads_values = False
    for stage in (stage1, stage2):
        for node in stage.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is check_size:
                _, expected, what, where = node.args
            elif node.target is check_size_read:
                _, _, expected, what, where = node.args
            elif node.target is check_value:
                _, read, expected, where = node.args
                what = f"the value read at {_where(stage, where)} ({read})"
                reads_values = True
            elif node.target is check_same_read:
                # Stage 2 reads ``what`` off a cached tensor: which one, and where, is part of
                # the plan (two plans may read a length off two different sizes).
                _, _, what, twin, where = node.args
                expected = {"read off": str(twin)}
            else:
                continue
            seen = values.setdefault(str(what), [])
            text = json.dumps(_plain(expected), sort_keys=True)
            if text not in seen:
                seen.append(text)
            lines.setdefault(str(what), _where(stage, where))
    entries = {what: _one_entry(texts) for what, texts in values.items()}
    return Signature(tuple(sorted(entries.items())), tuple(sorted(lines.items())), reads_values)


def _one_entry(texts: list[str]) -> str:
    """A ``what``'s entry: its expected value, or every value where checks of the same text
    expect different ones (a number baked at one line and read off a cached tensor at
    another): each is part of the plan, and a plan differing in any must have another key."""
    if len(texts) == 1:
        return texts[0]
    return json.dumps({"each of": [json.loads(text) for text in sorted(texts)]}, sort_keys=True)


def _where(stage: fx.GraphModule, where: Any) -> str:
    """The user's line a check names: written in the code, or looked up in stage 1's table."""
    if isinstance(where, fx.Node) and where.target is operator.getitem:
        table, index = where.args
        if isinstance(table, fx.Node) and table.op == "get_attr":
            return str(getattr(stage, str(table.target))[index])
    return str(where)


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list, torch.Size)):
        return [_plain(item) for item in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def example_record(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The example's shapes, dtypes and devices (plain values as they are) as JSON; None when
    it holds a value of another kind (a list of strings, an object) that JSON cannot rebuild."""
    try:
        record = {
            "args": [_record_value(value) for value in args],
            "kwargs": {name: _record_value(value) for name, value in kwargs.items()},
        }
    except TypeError:
        return None
    return json.dumps(record, sort_keys=True)


def example_from_record(text: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An example batch of the recorded shapes: zeros (the planning reads shapes only)."""
    record = json.loads(text)
    args = tuple(_rebuilt(value) for value in record["args"])
    return args, {name: _rebuilt(value) for name, value in record["kwargs"].items()}


def _record_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return {"tensor": list(value.shape), "dtype": dtype, "device": str(value.device)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(type(value).__name__)


def _rebuilt(value: dict[str, Any]) -> Any:
    if "value" in value:
        return value["value"]
    dtype = getattr(torch, value["dtype"])
    return torch.zeros(value["tensor"], dtype=dtype, device=value["device"])
