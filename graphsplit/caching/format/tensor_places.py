"""Where each tensor of a safetensors file lies, checked as safetensors checks it.

After :mod:`graphsplit.caching.format.strict_header` parses a header, this module places its
tensors and refuses a file whose places are wrong, by safetensors' own rules: the tensors'
byte ranges, sorted, cover the data exactly from its start to the file's end (no hole between
two tensors, no byte shared by two, no trailing byte), each range is as long as its dtype ×
shape needs (computed without overflow), and the dtype is one graphsplit reads into torch.

Every reader uses this one check: the local shard map, the ranged remote reader, the
read-through copies (they are local shards), and :func:`tensors_from_bytes`, the function the
Hugging Face export and import call on a whole file's bytes.

Glossary:
    tensor table: a checked file's tensors (name -> :class:`TensorPlace`, absolute offsets)
        and metadata (:class:`TensorTable`).
    read: a function ``read(start, end) -> bytes`` of the file (a memory map's slice, one
        ranged request): :func:`read_table` reads the header through it, nothing else.

In and out::

    check_places(header, file_size) -> TensorTable | HeaderProblem
    read_table(read, file_size) -> TensorTable | HeaderProblem     # length, header, places
    tensors_from_bytes(blob, source=..., fix=...) -> {name: Tensor}  # CorruptCacheError
    TensorTable.keys()  .metadata()  .places[name]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from graphsplit.caching.format.records import DAMAGED_FILE_FIX
from graphsplit.caching.format.strict_header import (
    LENGTH_BYTES,
    HeaderProblem,
    ParsedHeader,
    header_length,
    parse_header,
)
from graphsplit.caching.format.tensor_file import DTYPES_BY_CODE
from graphsplit.errors import CorruptCacheError, Fix, user_error

__all__ = [
    "TensorPlace",
    "TensorTable",
    "check_places",
    "read_table",
    "tensors_from_bytes",
]

_TORCH_MAX = 2**63 - 1  # torch sizes and strides are int64


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lies in a file (absolute byte offsets), its dtype and shape."""

    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorTable:
    """The tensors of a checked file, in header order, and its metadata."""

    places: Mapping[str, TensorPlace]
    metadata_strings: Mapping[str, str]

    def keys(self) -> list[str]:
        return list(self.places)

    def metadata(self) -> dict[str, str]:
        return dict(self.metadata_strings)


def check_places(header: ParsedHeader, file_size: int) -> TensorTable | HeaderProblem:
    """Each tensor's place in a ``file_size``-byte file, or why the places are wrong."""
    base = header.data_start
    places: dict[str, TensorPlace] = {}
    for name, entry in header.entries.items():
        dtype = DTYPES_BY_CODE.get(entry.dtype)
        if dtype is None:
            return HeaderProblem(
                f"tensor {name!r} has the dtype {entry.dtype!r}, which graphsplit does not read "
                f"(it reads {sorted(DTYPES_BY_CODE)})"
            )
        needed = _bytes_needed(entry.shape, dtype.itemsize)
        if needed is None:
            return HeaderProblem(f"tensor {name!r} has the shape {list(entry.shape)}, too large")
        start, end = entry.offsets
        if end < start or end - start != needed:
            return HeaderProblem(
                f"tensor {name!r} spans bytes {start}-{end}, not the {needed} bytes its "
                f"{entry.dtype} {list(entry.shape)} needs"
            )
        places[name] = TensorPlace(base + start, base + end, dtype, entry.shape)
    covered = base
    for name, place in sorted(places.items(), key=lambda item: (item[1].start, item[1].end)):
        if place.start != covered:
            what = "overlaps the tensor before it" if place.start < covered else "leaves a hole"
            return HeaderProblem(
                f"tensor {name!r} {what} (it starts at data byte {place.start - base}, the one "
                f"before ends at {covered - base})"
            )
        covered = place.end
    if covered != file_size:
        if covered > file_size:
            return HeaderProblem(f"its tensors end at byte {covered:,}, past the file's end")
        return HeaderProblem(
            f"it has {file_size - covered:,} bytes after its last tensor that no tensor covers"
        )
    return TensorTable(places, header.metadata)


def _bytes_needed(shape: tuple[int, ...], itemsize: int) -> int | None:
    """Bytes of a tensor of ``shape``, or None where safetensors (in 64 bits, dim by dim) or
    torch (int64 sizes and strides) would overflow."""
    count = 1
    for dim in shape:
        count *= dim
        if count > _TORCH_MAX:
            return None
    nonzero = 1
    for dim in shape:  # torch's strides multiply the other dims, even when one is 0
        nonzero *= max(dim, 1)
        if nonzero > _TORCH_MAX:
            return None
    total = count * itemsize
    return None if total > _TORCH_MAX else total


def read_table(read: Callable[[int, int], bytes], file_size: int) -> TensorTable | HeaderProblem:
    """Read and check a file's header through ``read`` (see the module glossary)."""
    length = header_length(read(0, min(LENGTH_BYTES, file_size)), file_size)
    if isinstance(length, HeaderProblem):
        return length
    header = parse_header(read(LENGTH_BYTES, LENGTH_BYTES + length))
    if isinstance(header, HeaderProblem):
        return header
    return check_places(header, file_size)


def tensors_from_bytes(
    blob: bytes | bytearray | memoryview,
    *,
    source: str = "the safetensors file",
    fix: Fix = DAMAGED_FILE_FIX,
) -> dict[str, torch.Tensor]:
    """The tensors of a whole safetensors file held in memory, each a fresh tensor (a copy
    of its bytes), after the same checks every cache reader makes.

    This is what the Hugging Face export and import read files with (instead of
    ``safetensors.torch.load``, which accepts a tensor named twice).

    Raises:
        CorruptCacheError: naming ``source``, what is wrong, and ``fix``.
    """
    view = memoryview(blob).cast("B")
    table = read_table(lambda start, end: bytes(view[start:end]), len(view))
    if isinstance(table, HeaderProblem):
        raise user_error(
            CorruptCacheError,
            f"{source} is not a valid safetensors file: {table}.",
            fix=Fix(fix.words, fix.option),  # the caller's fix (a Fix, typed)
        )
    tensors = {}
    for name, place in table.places.items():
        data = bytearray(view[place.start : place.end])
        if data:
            tensors[name] = torch.frombuffer(data, dtype=place.dtype).reshape(place.shape)
        else:
            tensors[name] = torch.empty(place.shape, dtype=place.dtype)
    return tensors
