"""The safetensors format, as graphsplit writes and reads it without the library.

graphsplit writes shards itself (:func:`graphsplit.caching.files.save_tensors`), so that every
write goes through one path, and reads remote shards by byte ranges
(:mod:`graphsplit.caching.ranged`); both need the format, described here once: an 8-byte
little-endian header length, the JSON header (padded with spaces to 8 bytes), then each
tensor's bytes at its ``data_offsets`` (relative to the end of the header).

In and out::

    serialise(tensors, metadata) -> (pieces, total bytes)   # widest dtype first, then by name
    safetensors_dtype(dtype, name) -> "F32"                 # or a CacheError naming the tensor
    layout(header, base, size) -> {name: TensorPlace} | problem   # checked against the file
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from graphsplit.errors import CacheError

__all__ = [
    "DTYPES_BY_CODE",
    "SAFETENSORS_DTYPES",
    "TensorPlace",
    "layout",
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
        raise CacheError(
            f"the boundary tensor {name!r} is {dtype}, which the safetensors format cannot "
            f"store.\n  fix: cast it in the training step to one of "
            f"{sorted(str(d).removeprefix('torch.') for d in SAFETENSORS_DTYPES)}"
        )
    return code


def serialise(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[list[Any], int]:
    """The file's bytes as pieces to write in order (the header, then each tensor's memory,
    widest dtype first, then by name: the same bytes on every run), and their total size."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        value = tensors[name]
        end = offset + value.numel() * value.element_size()
        header[name] = {
            "dtype": safetensors_dtype(value.dtype, name),
            "shape": list(value.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    pieces: list[Any] = [struct.pack("<Q", len(text)) + text]
    for name in order:
        value = tensors[name].detach().contiguous().reshape(-1)
        if value.numel():
            pieces.append(value.view(torch.uint8).numpy().data)
    return pieces, len(pieces[0]) + offset


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lies in a file (absolute byte offsets), its dtype and shape."""

    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def layout(header: Any, base: int, size: int) -> dict[str, TensorPlace] | str:
    """Each tensor's place, from a parsed header whose data starts at ``base`` in a file of
    ``size`` bytes; a problem (str) when an entry is malformed or lies outside the file."""
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    places: dict[str, TensorPlace] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES_BY_CODE[entry["dtype"]]
            shape = tuple(int(dim) for dim in entry["shape"])
            start, end = (base + int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return f"its header entry for {name!r} is malformed"
        numel = 1
        for dim in shape:
            numel *= dim
        if min(shape, default=0) < 0 or end - start != numel * dtype.itemsize:
            return f"tensor {name!r} has {end - start} bytes, not what {shape} needs"
        if not base <= start <= end <= size:
            return f"tensor {name!r} lies outside the file"
        places[name] = TensorPlace(start, end, dtype, shape)
    return places
