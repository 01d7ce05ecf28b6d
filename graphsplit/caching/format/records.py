"""Strict JSON to dataclasses and back, driven by the dataclasses' own fields.

The cache format's records (:mod:`graphsplit.caching.format.layout`) are plain frozen dataclasses;
their fields, type hints and the rules :func:`json_field` attaches are the schema. This module
reads a JSON document into such a dataclass, refusing anything else, and writes one back; no
record is read or written field by field by hand.

Glossary:
    rule: what a field adds to its type: its JSON name, a minimum, a pattern, identifier-only,
        a set of choices, ``inline``, ``optional`` or ``stored=False``; a rule on a list or
        mapping field applies to its items.
    optional: a field left out of its JSON object when it is None (and read as None when
        absent), so that a field added to a record changes no file written without it; a
        field without a rule that defaults to None is optional too.
    inline: a field whose dataclass's fields sit in the enclosing JSON object instead of under
        a key of their own (the manifest holds the header's fields at its top level).
    where: a value's path in its document as error messages name it, e.g. ``shards[3].keys[0]``
        or ``fingerprint.versions.torch``; empty for the document itself.
    types: ``str``, ``int``, ``float`` (finite), ``torch.dtype`` (by name), ``X | None``,
        ``tuple[X, ...]`` (a list), ``Mapping[str, X]`` (an object) and dataclasses.

In and out::

    json_field(json_name=None, *, minimum=0, pattern=None, meaning="", identifier=False,
               choices=(), inline=False, optional=False, stored=True, **field_options) -> Field
    json_names(cls) -> tuple[str, ...]          # the keys a document of ``cls`` holds, in order
    optional_names(cls) -> frozenset[str]       # those of them that may be absent
    to_json(record) -> dict                     # JSON-ready, in field order
    JsonReader(path).parse(data) -> dict        # UTF-8, no repeated keys, no NaN, nesting
                                                # bounded by the stack (``path`` names it only)
    JsonReader(path).read(cls, document, where="") -> cls
    JsonReader(path).fail(where, problem)       # raises ManifestError naming file and field
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from graphsplit.errors import Fix, ManifestError, Remedy, TornFileError, user_error

__all__ = [
    "DAMAGED_FILE_FIX",
    "REBUILD",
    "JsonReader",
    "Rule",
    "json_field",
    "json_names",
    "optional_names",
    "to_json",
]

REBUILD = "rebuild the cache (run cache again with {remedy})"
# The fix for a cache file that does not read: damaged (a torn write, a bit flip) or foreign.
DAMAGED_FILE_FIX = Fix(
    f"the file is damaged or was not written by graphsplit; {REBUILD}", Remedy.OVERWRITE
)
_RULE = "graphsplit.caching.format.records"  # the key of a field's rule in its metadata


@dataclass(frozen=True)
class Rule:
    """What a field's JSON form adds to its type (see the module glossary)."""

    json_name: str | None = None
    minimum: int = 0
    pattern: re.Pattern[str] | None = None
    meaning: str = ""  # what ``pattern`` accepts, in words: "64 lowercase hex digits"
    identifier: bool = False
    choices: tuple[str, ...] = ()
    inline: bool = False
    optional: bool = False
    stored: bool = True


def json_field(
    json_name: str | None = None,
    *,
    minimum: int = 0,
    pattern: re.Pattern[str] | None = None,
    meaning: str = "",
    identifier: bool = False,
    choices: tuple[str, ...] = (),
    inline: bool = False,
    optional: bool = False,
    stored: bool = True,
    **field_options: Any,
) -> Any:
    """A dataclass field carrying a :class:`Rule`; ``field_options`` go to ``dataclasses.field``.

    Example:
        >>> @dataclass(frozen=True)
        ... class Shard:
        ...     size: int = json_field("bytes", minimum=1)
        >>> try:
        ...     JsonReader(Path("shard.json")).read(Shard, {"bytes": 0})
        ... except ManifestError as error:
        ...     print(str(error).splitlines()[0])
        shard.json is not a valid graphsplit cache file: bytes is int 0; expected an integer >= 1.
    """
    rule = Rule(json_name, minimum, pattern, meaning, identifier, choices, inline, optional, stored)
    return dataclasses.field(metadata={_RULE: rule}, **field_options)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, Rule], ...]:
    """``(attribute, type hint, rule)`` of each stored field of ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        # A field without a rule is optional where it defaults to None: a record defined below
        # this package (BoundarySpec's ``pad_dim``) cannot attach a rule, and a field added so
        # must still read from the files written before it.
        rule = field.metadata.get(_RULE, Rule(optional=field.default is None))
        if rule.stored:
            found.append((field.name, hints[field.name], rule))
    return tuple(found)


def json_names(cls: type) -> tuple[str, ...]:
    """The keys a JSON document of ``cls`` holds, in order (inline fields' keys in place)."""
    names: list[str] = []
    for name, hint, rule in _fields(cls):
        names += json_names(hint) if rule.inline else [rule.json_name or name]
    return tuple(names)


@functools.cache
def optional_names(cls: type) -> frozenset[str]:
    """The keys of :func:`json_names` that a document of ``cls`` may leave out."""
    names: set[str] = set()
    for name, hint, rule in _fields(cls):
        if rule.inline:
            names |= optional_names(hint)
        elif rule.optional:
            names.add(rule.json_name or name)
    return frozenset(names)


_PLAIN = frozenset({int, str, float, bool, type(None)})


def to_json(value: Any) -> Any:
    """``value`` as JSON-ready data: dataclasses by their fields, tuples as lists, dtypes by name.

    Example:
        >>> @dataclass(frozen=True)
        ... class Row:
        ...     shape: tuple[int, ...]
        ...     dtype: torch.dtype
        >>> to_json(Row((2, 3), torch.bfloat16))
        {'shape': [2, 3], 'dtype': 'bfloat16'}
    """
    kind = type(value)
    if kind in _PLAIN:  # most values of a manifest: checked first, by exact type
        return value
    if kind is tuple or kind is list:
        return [to_json(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        document: dict[str, Any] = {}
        for name, _, rule in _fields(type(value)):
            item = to_json(getattr(value, name))
            if rule.optional and item is None:
                continue
            if rule.inline:
                document.update(item)
            else:
                document[rule.json_name or name] = item
        return document
    if isinstance(value, Mapping):
        return {str(key): to_json(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [to_json(item) for item in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


class JsonReader:
    """Reads one JSON file strictly; every refusal is a :class:`ManifestError` naming the file,
    the field and the fix."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> NoReturn:
        reason = (
            f"{self.path} is not a valid graphsplit cache file: {where or 'the document'} "
            f"{problem}."
        )
        raise user_error(ManifestError, reason, fix=DAMAGED_FILE_FIX)

    def parse(self, data: bytes) -> dict[str, Any]:
        """The file's bytes as its JSON object: UTF-8, no key twice in one object, no NaN or
        Infinity (reading the bytes is the store's: :mod:`graphsplit.caching.store.record_files`).

        Raises:
            TornFileError: empty or not JSON at all; ManifestError: not an object, or nested
                deeper than any graphsplit record.
        """
        try:
            text = data.decode("utf-8")
            document = json.loads(
                text, object_pairs_hook=_unique_object, parse_constant=_reject_constant
            )
        except RecursionError:  # a "JSON bomb": no graphsplit record nests deeper than ~10
            self.fail("", "nests lists or objects too deeply for a graphsplit record")
        except (UnicodeDecodeError, ValueError) as error:
            problem = "is empty" if not data.strip() else f"is not valid JSON ({error})"
            raise user_error(
                TornFileError, f"{self.path} {problem}.", fix=DAMAGED_FILE_FIX
            ) from None
        return self.mapping(document, "")

    def read(self, cls: type, value: Any, where: str = "") -> Any:
        """``value`` as a ``cls``: exactly its fields, each of its type and rule."""
        document = self.mapping(value, where)
        self.require_names(document, where, json_names(cls), optional=optional_names(cls))
        return self._build(cls, document, where)

    def require_names(
        self,
        document: Mapping[str, Any],
        where: str,
        names: tuple[str, ...],
        *,
        optional: frozenset[str] = frozenset(),
    ) -> None:
        missing = [name for name in names if name not in document and name not in optional]
        if missing:
            self.fail(where, f"lacks the field(s) {missing}")
        extra = sorted(set(document) - set(names))
        if extra:
            self.fail(where, f"has unexpected field(s) {extra}")

    def mapping(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"is {_kind(value)}; expected an object")
        return value

    def sequence(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(where, f"is {_kind(value)}; expected a list")
        return value

    def _build(self, cls: type, document: Mapping[str, Any], where: str) -> Any:
        values = {}
        for name, hint, rule in _fields(cls):
            if rule.inline:
                values[name] = self._build(hint, document, where)
            else:
                key = rule.json_name or name
                if rule.optional and key not in document:
                    values[name] = None
                    continue
                values[name] = self._value(hint, rule, document[key], _join(where, key))
        return cls(**values)

    def _value(self, hint: Any, rule: Rule, value: Any, where: str, *, nullable: bool = False):
        origin, arguments, is_record = _parts(hint)
        if origin in (typing.Union, types.UnionType):
            options = [option for option in arguments if option is not type(None)]
            assert len(options) == 1, f"{hint}: one type or None"
            if value is None:
                return None
            return self._value(options[0], rule, value, where, nullable=True)
        if origin is tuple:
            assert arguments[1:] == (Ellipsis,), f"{hint}: tuples are tuple[X, ...]"
            items = self.sequence(value, where)
            if _plain_items(arguments[0], rule, items):
                return tuple(items)
            return tuple(
                self._value(arguments[0], rule, item, f"{where}[{index}]")
                for index, item in enumerate(items)
            )
        if origin in (Mapping, dict):
            return {
                key: self._value(arguments[1], rule, item, _join(where, key))
                for key, item in self.mapping(value, where).items()
            }
        if is_record:
            return self.read(hint, value, where)
        read = _SCALARS.get(hint)
        assert read is not None, f"no JSON form for {hint}"
        return read(self, value, where, rule, nullable)

    def _text(self, value: Any, where: str, rule: Rule, nullable: bool) -> str:
        if not isinstance(value, str):
            self.fail(where, f"is {_kind(value)}; expected a string")
        if rule.identifier and not value.isidentifier():
            self.fail(where, f"is {value!r}; expected a Python identifier")
        if rule.pattern is not None and not rule.pattern.fullmatch(value):
            self.fail(where, f"is {value!r}, not {rule.meaning}")
        if rule.choices and value not in rule.choices:
            either = "null or " if nullable else ""
            self.fail(where, f"is {value!r}; expected {either}one of {rule.choices}")
        return value

    def _integer(self, value: Any, where: str, rule: Rule, nullable: bool) -> int:
        if type(value) is not int or value < rule.minimum:
            self.fail(where, f"is {_kind(value)}; expected an integer >= {rule.minimum}")
        return value

    def _number(self, value: Any, where: str, rule: Rule, nullable: bool) -> float:
        if type(value) not in (int, float) or not math.isfinite(value) or value < rule.minimum:
            self.fail(where, f"is {_kind(value)}; expected a finite number >= {rule.minimum}")
        return float(value)

    def _dtype(self, value: Any, where: str, rule: Rule, nullable: bool) -> torch.dtype:
        dtype = getattr(torch, self._text(value, where, rule, nullable), None)
        if not isinstance(dtype, torch.dtype):
            self.fail(where, f"names an unknown dtype {value!r}")
        return dtype


_SCALARS: dict[Any, Callable[..., Any]] = {
    str: JsonReader._text,
    int: JsonReader._integer,
    float: JsonReader._number,
    torch.dtype: JsonReader._dtype,
}


@functools.cache
def _parts(hint: Any) -> tuple[Any, tuple[Any, ...], bool]:
    """``hint``'s origin, arguments and whether it is a record: asked once per hint, not once
    per value (a manifest of a few hundred samples holds thousands of values)."""
    return typing.get_origin(hint), typing.get_args(hint), dataclasses.is_dataclass(hint)


def _plain_items(hint: Any, rule: Rule, items: list[Any]) -> bool:
    """Whether every item of a list of ints or strings passes ``rule`` (shapes, sample keys):
    checked at once; a list that does not is read item by item, which names the bad one."""
    if hint is int:
        return all(type(item) is int and item >= rule.minimum for item in items)
    if hint is str:
        pattern, choices = rule.pattern, rule.choices
        return all(
            type(item) is str
            and (not rule.identifier or item.isidentifier())
            and (pattern is None or pattern.fullmatch(item) is not None)
            and (not choices or item in choices)
            for item in items
        )
    return False


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _kind(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"the key {key!r} appears twice in one object")
        document[key] = value
    return document


def _reject_constant(name: str) -> Callable[[], None]:
    raise ValueError(f"{name} is not a JSON number")
