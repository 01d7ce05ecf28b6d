"""The artifacts that flow between graphsplit's pipeline steps.

Glossary:
    boundary value: a tensor computed by stage 1 and consumed by stage 2; the cache stores it.
    batch dim: the dimension of a boundary tensor that indexes samples; ``None`` marks a
        per-dataset constant (computed from frozen weights alone, stored once).
    bytes per sample: what one sample of a boundary value costs on disk.
    source: the user's ``file:line`` that produced a value, for reports and errors.

Everything here is a small frozen dataclass or a plain mapping so that plans serialise to JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BoundarySpec:
    """One tensor that crosses from stage 1 to stage 2.

    ``shape`` is the shape seen at trace time (the example batch); ``shape[batch_dim]`` varies
    with the batch size, the other dims may vary between samples (aspect-ratio buckets).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    batch_dim: int | None
    bytes_per_sample: int
    source: str

    @property
    def is_constant(self) -> bool:
        """True for a per-dataset constant, stored once rather than per sample."""
        return self.batch_dim is None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; ``dtype`` as its name without the ``torch.`` prefix."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch_dim": self.batch_dim,
            "bytes_per_sample": self.bytes_per_sample,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BoundarySpec:
        """Inverse of :meth:`to_json`; raises ``ValueError`` on an unknown dtype."""
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {data['dtype']!r} in boundary spec {data['name']!r}")
        batch_dim = data["batch_dim"]
        return cls(
            name=str(data["name"]),
            shape=tuple(int(size) for size in data["shape"]),
            dtype=dtype,
            batch_dim=None if batch_dim is None else int(batch_dim),
            bytes_per_sample=int(data["bytes_per_sample"]),
            source=str(data["source"]),
        )
