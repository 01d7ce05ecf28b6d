"""The safetensors format, as graphsplit writes and reads it without the library.

graphsplit writes shards itself (:func:`graphsplit.caching.store.file_writes.save_tensors`), so
that every write goes through one path, and reads remote shards by byte ranges
(:mod:`graphsplit.caching.store.ranged`); both need the format, described here once: an 8-byte
little-endian header length, the JSON header (padded with spaces to 8 bytes), then each
tensor's bytes at its ``data_offsets`` (relative to the end of the header).

Glossary:
    tensor bytes: a tensor as what a file holds of it: its dtype, its shape and its memory as
        one C-contiguous run of bytes (:class:`TensorBytes`). The rows the writer cuts from a
        batch tensor are slices of one such run (:func:`rows_of`): a slice costs a fraction
        of a microsecond, where a torch view and the four calls that reach its memory cost
        several (serialising a 256 MiB shard of 1,424 rows: 4.3 ms instead of 15.3 ms).

In and out::

    serialise(tensors, metadata) -> (pieces, total bytes)   # widest dtype first, then by name
    rows_of(values) -> [TensorBytes]                        # each row along dim 0
    as_bytes(tensor) -> TensorBytes
    safetensors_dtype(dtype, name) -> "F32"                 # or a CacheError naming the tensor

Reading the format (one strict parser and one check of the tensors' places, for every reader)
is :mod:`graphsplit.caching.format.strict_header` and
:mod:`graphsplit.caching.format.tensor_places`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphsplit.errors import CacheError, Fix, user_error

__all__ = [
    "DTYPES_BY_CODE",
    "SAFETENSORS_DTYPES",
    "TensorBytes",
    "as_bytes",
    "rows_of",
    "safetensors_dtype",
    "serialise",
]

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    **{
        getattr(torch, name): code
        for name, code in [
            ("uint16", "U16"),
            ("uint32", "U32"),
            ("uint64", "U64"),
            ("float8_e4m3fn", "F8_E4M3"),
            ("float8_e5m2", "F8_E5M2"),
            ("complex64", "C64"),
        ]
        if hasattr(torch, name)
    },
}
DTYPES_BY_CODE = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype, name: str) -> str:
    """The safetensors name of ``dtype`` (``"F32"``), or a CacheError naming the tensor."""
    code = SAFETENSORS_DTYPES.get(dtype)
    if code is None:
        raise user_error(
            CacheError,
            f"the boundary tensor {name!r} is {dtype}, which the safetensors format cannot store.",
            fix=Fix(
                "cast it in the training step to one of "
                f"{sorted(str(d).removeprefix('torch.') for d in SAFETENSORS_DTYPES)}"
            ),
        )
    return code


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """One tensor as a file holds it: dtype, shape, and its memory as bytes (``data``: a
    C-contiguous ``memoryview`` of format ``"B"`` that keeps the tensor's memory alive)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: memoryview


def as_bytes(tensor: torch.Tensor) -> TensorBytes:
    """``tensor``'s dtype, shape and memory (copied first only if it is not contiguous)."""
    return TensorBytes(tensor.dtype, tuple(tensor.shape), _memory(tensor))


def rows_of(values: torch.Tensor) -> list[TensorBytes]:
    """Each row of ``values`` along dim 0, as slices of the memory of one contiguous copy
    (none when ``values`` is contiguous already)."""
    memory = _memory(values)
    count = values.shape[0]
    size = len(memory) // count if count else 0
    shape = tuple(values.shape[1:])
    return [
        TensorBytes(values.dtype, shape, memory[row * size : (row + 1) * size])
        for row in range(count)
    ]


def _memory(tensor: torch.Tensor) -> memoryview:
    # numpy has no bfloat16 or float8: reach the memory as bytes. reshape(-1) of a contiguous
    # tensor (0-dim included) is a view; of any other a contiguous copy.
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def serialise(
    tensors: Mapping[str, torch.Tensor | TensorBytes], metadata: dict[str, str]
) -> tuple[list[memoryview], int]:
    """The file's bytes as pieces to write in order (the header, then each tensor's memory,
    widest dtype first, then by name: the same bytes on every run), and their total size.
    Tensors are written straight from their memory (a non-contiguous one is copied first)."""
    entries = {
        name: value if isinstance(value, TensorBytes) else as_bytes(value)
        for name, value in tensors.items()
    }
    order = sorted(entries, key=lambda name: (-entries[name].dtype.itemsize, name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        entry = entries[name]
        end = offset + len(entry.data)
        header[name] = {
            "dtype": safetensors_dtype(entry.dtype, name),
            "shape": list(entry.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    pieces = [memoryview(struct.pack("<Q", len(text)) + text)]
    pieces += [entries[name].data for name in order if len(entries[name].data)]
    return pieces, len(pieces[0]) + offset
