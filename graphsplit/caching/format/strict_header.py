"""A safetensors header, parsed as strictly as the safetensors library parses it (or more).

Every reader of a safetensors file in graphsplit (a local shard's memory map, a remote shard's
ranged reads, a read-through copy, the Hugging Face export and import) parses the header here,
so that no reader accepts a file another refuses. The rules are safetensors' own (its Rust
parser, serde_json), written out:

- an 8-byte little-endian header length, at most 100,000,000 and within the file;
- the header is UTF-8 (no byte-order mark: JSON has none), one JSON object, then only JSON
  whitespace (the writer's padding); no NaN or Infinity, no lone surrogate escapes;
- ``__metadata__`` is absent, null or an object of strings to strings;
- every other key is a tensor: an object with ``dtype`` (a safetensors code), ``shape`` (a
  list of exact non-negative integers below 2**64) and ``data_offsets`` (exactly two of them);
  numbers written as strings, floats (``2.0``, ``2e0``, ``-0``) or booleans are refused.
  Other fields of a tensor's entry are ignored, as safetensors ignores them.

One rule is stricter than safetensors: no key may appear twice in one object (safetensors
keeps the last of two entries of a tensor, so a file could name one tensor twice, the first
pointing at bytes a checker sees and the last at bytes a reader serves).

Where the tensors' bytes lie (bounds, overlaps, holes, dtype × shape) is checked by
:mod:`graphsplit.caching.format.tensor_places`.

Glossary:
    problem: what is wrong with a file, in words (no file name: the caller names the file),
        returned as a :class:`HeaderProblem` value, never raised.

In and out::

    header_length(first_8_bytes, file_size) -> int | HeaderProblem
    parse_header(header_bytes) -> ParsedHeader | HeaderProblem
    ParsedHeader.entries: {name: HeaderEntry(dtype, shape, offsets)}    .metadata: {str: str}
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LENGTH_BYTES",
    "MAX_HEADER_BYTES",
    "HeaderEntry",
    "HeaderProblem",
    "ParsedHeader",
    "header_length",
    "parse_header",
]

LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound
_U64_MAX = 2**64 - 1
_JSON_WHITESPACE = " \t\n\r"
_METADATA = "__metadata__"


@dataclass(frozen=True)
class HeaderProblem:
    """Why a file is not a safetensors file graphsplit reads (``reason`` in words)."""

    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as its header entry describes it; offsets relative to the data's start."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


@dataclass(frozen=True)
class ParsedHeader:
    """A header that follows every rule of the module docstring (places not yet checked)."""

    length: int  # bytes of JSON after the 8-byte length: the data starts at 8 + length
    entries: Mapping[str, HeaderEntry]
    metadata: Mapping[str, str]

    @property
    def data_start(self) -> int:
        return LENGTH_BYTES + self.length


def header_length(first: bytes | bytearray | memoryview, file_size: int) -> int | HeaderProblem:
    """The header length the file's first 8 bytes declare, if it fits a ``file_size``-byte file."""
    if file_size < LENGTH_BYTES or len(first) < LENGTH_BYTES:
        return HeaderProblem(f"it has {file_size} bytes, too few for a safetensors file")
    (length,) = struct.unpack_from("<Q", first, 0)
    if length > MAX_HEADER_BYTES:
        return HeaderProblem(
            f"it declares a {length:,}-byte header, more than safetensors' bound of "
            f"{MAX_HEADER_BYTES:,}"
        )
    if LENGTH_BYTES + length > file_size:
        return HeaderProblem(f"it declares a {length:,}-byte header in a {file_size:,}-byte file")
    return length


def parse_header(text: bytes | bytearray | memoryview) -> ParsedHeader | HeaderProblem:
    """The header's JSON bytes (after the 8-byte length) as a :class:`ParsedHeader`."""
    try:
        decoded = bytes(text).decode("utf-8")
    except UnicodeDecodeError as error:
        return HeaderProblem(f"its header is not UTF-8 ({error.reason} at byte {error.start})")
    if decoded.startswith("\ufeff"):
        return HeaderProblem("its header starts with a byte-order mark, which JSON does not allow")
    try:
        document = json.loads(
            decoded, object_pairs_hook=_unique_object, parse_constant=_reject_constant
        )
    except RecursionError:
        return HeaderProblem("its header nests lists or objects too deeply")
    except _Duplicate as error:
        return HeaderProblem(f"its header names {error.args[0]!r} twice in one object")
    except ValueError as error:
        return HeaderProblem(f"its header is not JSON ({error})")
    if not isinstance(document, dict):
        return HeaderProblem(f"its header is a JSON {type(document).__name__}, not an object")
    metadata = document.pop(_METADATA, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())
    ):
        return HeaderProblem("its __metadata__ is not an object of strings")
    entries: dict[str, HeaderEntry] = {}
    for name, entry in document.items():
        parsed = _entry(name, entry)
        if isinstance(parsed, HeaderProblem):
            return parsed
        entries[name] = parsed
    strings = [*entries, *(metadata or {}), *(metadata or {}).values()]
    strings += [entry.dtype for entry in entries.values()]
    if not all(_encodable(text) for text in strings):
        return HeaderProblem("its header holds a lone surrogate escape (not UTF-8)")
    return ParsedHeader(len(text), entries, dict(metadata or {}))


def _entry(name: str, entry: Any) -> HeaderEntry | HeaderProblem:
    if not isinstance(entry, dict):
        return HeaderProblem(f"its header entry for {name!r} is not an object")
    missing = [field for field in ("dtype", "shape", "data_offsets") if field not in entry]
    if missing:
        return HeaderProblem(f"its header entry for {name!r} lacks {missing}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        return HeaderProblem(f"tensor {name!r} has the dtype {dtype!r}, not a string")
    if not (isinstance(shape, list) and all(_exact(dim) for dim in shape)):
        return HeaderProblem(
            f"tensor {name!r} has the shape {_short(shape)}, not a list of exact integers >= 0"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_exact, offsets))):
        return HeaderProblem(
            f"tensor {name!r} has the data_offsets {_short(offsets)}, not two exact integers >= 0"
        )
    return HeaderEntry(dtype, tuple(shape), (offsets[0], offsets[1]))


def _exact(value: Any) -> bool:
    """An integer written as one (not ``2.0``, ``"2"`` or ``true``) that fits in 64 bits."""
    return type(value) is int and 0 <= value <= _U64_MAX


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: Any) -> str:
    text = json.dumps(value)  # parsed from JSON without NaN: it dumps back
    return text if len(text) <= 60 else text[:57] + "..."


class _Duplicate(Exception):
    """A key appears twice in one JSON object (not a ValueError: reported as itself)."""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _Duplicate(key)
        document[key] = value
    return document


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")
