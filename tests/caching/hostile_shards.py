"""Hostile variants of a shard graphsplit wrote, for the differential reader test.

Each :class:`Variant` is a whole file made from a real shard (its header as JSON, its data),
changed in one way an attacker or a broken tool could change it, and the verdict every reader
must reach: :data:`ACCEPT` (the same tensors, laid out or spelled differently: every reader
serves the original rows), :data:`REFUSE` (safetensors refuses it, and so must every
graphsplit reader), or :data:`STRICTER` (safetensors accepts it, graphsplit refuses it on
purpose: a key named twice in one object, where safetensors keeps the last entry).

In and out::

    variants(shard_bytes) -> [Variant(name, blob, verdict)]
    variant_names() -> [name]     # the same list's names (of a small shard made here)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ACCEPT = "accept"
REFUSE = "refuse"
STRICTER = "stricter"  # safetensors accepts; graphsplit refuses (see the module docstring)


@dataclass(frozen=True)
class Variant:
    name: str
    blob: bytes
    verdict: str

    @property
    def graphsplit_accepts(self) -> bool:
        return self.verdict == ACCEPT

    @property
    def safetensors_accepts(self) -> bool:
        return self.verdict in (ACCEPT, STRICTER)


def split_file(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header (parsed) and its data bytes."""
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def assemble(text: bytes | str, data: bytes) -> bytes:
    """A file of header bytes ``text`` (any bytes at all) and ``data``."""
    text = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(text)) + text + data


def _json(header: dict[str, Any]) -> str:
    return json.dumps(header, separators=(",", ":"))


def _tensors(header: dict[str, Any]) -> list[str]:
    """Tensor names in data order."""
    names = [name for name in header if name != "__metadata__"]
    return sorted(names, key=lambda name: header[name]["data_offsets"])


def variants(blob: bytes) -> list[Variant]:
    """Every hostile (and harmless) variant of the shard ``blob`` (see the module docstring);
    the shard needs two tensors of one shape and dtype (rows 0 and 1 of one boundary tensor)."""
    header, data = split_file(blob)
    order = _tensors(header)
    first, last = order[0], order[-1]
    twin_a, twin_b = _twins(header)
    found: list[Variant] = []

    def add(name: str, text: bytes | str, verdict: str, body: bytes = data) -> None:
        found.append(Variant(name, assemble(text, body), verdict))

    def changed(change: Callable[[dict[str, Any]], Any]) -> str:
        copy = json.loads(json.dumps(header))
        change(copy)
        return _json(copy)

    # The same tensors, laid out or spelled otherwise: every reader accepts them.
    add("as written", blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]], ACCEPT)
    reversed_header, reversed_data = _reversed(header, data)
    add("data in another order", _json(reversed_header), ACCEPT, reversed_data)
    add("indented header after whitespace", "\n \t" + json.dumps(header, indent=2), ACCEPT)
    add(
        "more metadata, not ASCII",
        changed(lambda h: h["__metadata__"].update(note="caché ✓")),
        ACCEPT,
    )
    add(
        "an unknown field in an entry",
        changed(lambda h: h[first].update(comment=[1, {"x": None}])),
        ACCEPT,
    )

    # Numbers that are not exact integers (the old ranged reader took int("16"), int(2.25)).
    start, end = header[first]["data_offsets"]
    add(
        "offset as a string",
        changed(lambda h: h[first].update(data_offsets=[start, str(end)])),
        REFUSE,
    )
    add(
        "offset as a float",
        changed(lambda h: h[first].update(data_offsets=[start, end + 0.0])),
        REFUSE,
    )
    add("offset as false", changed(lambda h: h[first].update(data_offsets=[False, end])), REFUSE)
    dims = header[first]["shape"]
    add(
        "dim as 2.25", changed(lambda h: h[first].update(shape=[dims[0] + 0.25, *dims[1:]])), REFUSE
    )
    add(
        "dim as a string",
        changed(lambda h: h[first].update(shape=[str(dims[0]), *dims[1:]])),
        REFUSE,
    )
    add("negative offset", changed(lambda h: h[first].update(data_offsets=[-1, end])), REFUSE)
    add(
        "offset beyond 64 bits",
        changed(lambda h: h[last].update(data_offsets=[h[last]["data_offsets"][0], 2**64])),
        REFUSE,
    )
    add("three offsets", changed(lambda h: h[first].update(data_offsets=[start, end, end])), REFUSE)
    add("NaN offset", _json(header).replace(f"[{start},{end}]", f"[{start},NaN]", 1), REFUSE)

    # Metadata that is not an object of strings (the old ranged reader str()'d it).
    keys = header["__metadata__"]["graphsplit_keys"]
    add(
        "metadata value a list",
        changed(lambda h: h["__metadata__"].update(graphsplit_keys=json.loads(keys))),
        REFUSE,
    )
    add("metadata a list", changed(lambda h: h.update(__metadata__=[keys])), REFUSE)

    # Text that is not the JSON object safetensors parses.
    add("UTF-8 byte-order mark", b"\xef\xbb\xbf" + _json(header).encode(), REFUSE)
    add(
        "not UTF-8",
        _json(header).encode().replace(b"graphsplit_keys", b"graphsplit_k\xffys"),
        REFUSE,
    )
    add(
        "lone surrogate escape",
        changed(lambda h: h["__metadata__"].update(x="?")).replace('"x":"?"', '"x":"\\ud800"'),
        REFUSE,
    )
    add("a NUL after the object", _json(header) + "\x00", REFUSE)
    add("a list, not an object", json.dumps([header]), REFUSE)
    add("an unknown dtype", changed(lambda h: h[first].update(dtype="X99")), REFUSE)
    add("an entry without offsets", changed(lambda h: h[first].pop("data_offsets")), REFUSE)

    # Places that do not tile the data exactly.
    add("trailing bytes", _json(header), REFUSE, data + b"\x00" * 8)
    add(
        "a hole before the last tensor", _hole(header, last), REFUSE, _insert(data, header[last], 8)
    )
    add("a truncated file", _json(header), REFUSE, data[:-1])
    add(
        "dtype x shape is not the length",
        changed(lambda h: h[first].update(shape=[dims[0] + 1, *dims[1:]])),
        REFUSE,
    )
    shared_header, shared_data = _shared(header, data, twin_a, twin_b)
    add("two tensors share bytes", _json(shared_header), REFUSE, shared_data)

    # Header lengths that do not fit.
    text = _json(header).encode()
    found.append(
        Variant(
            "header longer than the file",
            struct.pack("<Q", len(text) + len(data) + 1) + text + data,
            REFUSE,
        )
    )
    found.append(
        Variant("header over 100 MB", struct.pack("<Q", 100_000_001) + text + data, REFUSE)
    )
    found.append(Variant("fewer than 8 bytes", b"\x01\x00", REFUSE))

    # A key named twice: safetensors keeps the last entry, graphsplit refuses the file.
    entry = _json({first: header[first]})[1:-1]
    pointing = _json({twin_a: header[twin_b]})[1:-1]
    add(
        "a tensor named twice, the last elsewhere",
        _json(header)[:-1] + "," + pointing + "}",
        REFUSE,
    )
    add("a tensor named twice, alike", _json(header)[:-1] + "," + entry + "}", STRICTER)
    meta = _json(header).replace(
        '{"graphsplit_keys":', '{"graphsplit_keys":"[]","graphsplit_keys":', 1
    )
    add("a metadata key named twice", meta, STRICTER)
    return found


def _twins(header: dict[str, Any]) -> tuple[str, str]:
    """Two tensors of one dtype and shape, the first before the second in the data."""
    order = _tensors(header)
    for index, name in enumerate(order):
        for other in order[index + 1 :]:
            if (header[name]["dtype"], header[name]["shape"]) == (
                header[other]["dtype"],
                header[other]["shape"],
            ):
                return name, other
    raise AssertionError("the shard needs two tensors of one dtype and shape")


def _reversed(header: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
    """The same tensors, their bytes in the opposite order."""
    copy = json.loads(json.dumps(header))
    pieces, offset = [], 0
    for name in reversed(_tensors(header)):
        start, end = header[name]["data_offsets"]
        pieces.append(data[start:end])
        copy[name]["data_offsets"] = [offset, offset + end - start]
        offset += end - start
    return copy, b"".join(pieces)


def _hole(header: dict[str, Any], name: str) -> str:
    copy = json.loads(json.dumps(header))
    start, end = copy[name]["data_offsets"]
    copy[name]["data_offsets"] = [start + 8, end + 8]
    return _json(copy)


def _insert(data: bytes, entry: dict[str, Any], count: int) -> bytes:
    start = entry["data_offsets"][0]
    return data[:start] + b"\x00" * count + data[start:]


def _shared(
    header: dict[str, Any], data: bytes, keep: str, drop: str
) -> tuple[dict[str, Any], bytes]:
    """``drop`` pointing at ``keep``'s bytes, its own bytes removed (the later ones moved)."""
    copy = json.loads(json.dumps(header))
    start, end = header[drop]["data_offsets"]
    size = end - start
    for name in _tensors(header):
        begin, finish = header[name]["data_offsets"]
        if begin >= end:
            copy[name]["data_offsets"] = [begin - size, finish - size]
    copy[drop]["data_offsets"] = list(copy[keep]["data_offsets"])
    return copy, data[:start] + data[end:]


def variant_names() -> list[str]:
    """The names :func:`variants` gives any shard (for test ids, before a cache exists)."""
    import torch

    from graphsplit.caching.format.tensor_file import serialise

    rows = {f"{row}/x": torch.zeros(2, 2) for row in range(2)}
    pieces, _ = serialise(rows, {"graphsplit_keys": '["a", "b"]'})
    return [variant.name for variant in variants(b"".join(bytes(piece) for piece in pieces))]
