"""A shard's rows as views of its memory map, so reading an item copies nothing.

``safe_open(...).get_tensor`` copies each row out of the file's map, and :func:`collate` then
copies it again into the batch. Here an item's tensors are views of a private (copy-on-write)
map of the shard, so the batch's ``torch.stack`` is the only copy; the page cache is read in
place.

Glossary:
    mapped shard: a shard accepted by safetensors (names, dtypes, shapes, the keys inside it,
        against the manifest) and mapped once; :meth:`MappedShard.get_tensor` returns a view.

In and out::

    open_mapped(folder, record, manifest) -> (MappedShard | None, problem | None)
    MappedShard.get_tensor(name) -> Tensor        # a view of the map (cloned if misaligned)

The views share memory with each other and with the map: writing into an item changes this
process's copy of the page only (never the file), and the same row read again sees the change.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from graphsplit.caching.format.layout import Manifest, ShardRecord
from graphsplit.caching.format.shard_header import shard_tensors_problem
from graphsplit.caching.format.tensor_file import TensorPlace, layout
from graphsplit.caching.store import regular_files
from graphsplit.errors import UnsafeFileError

__all__ = ["MappedShard", "open_mapped"]


class MappedShard:
    """The tensors of one shard file as views of its memory map (see the module docstring)."""

    def __init__(self, mapped: mmap.mmap, places: dict[str, TensorPlace]) -> None:
        # frombuffer keeps ``mapped`` alive as long as any view of it is.
        self._bytes = torch.frombuffer(mapped, dtype=torch.uint8)
        self._places = places

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of the map (KeyError if the shard has no such tensor)."""
        place = self._places[name]
        data = self._bytes[place.start : place.end]
        if place.start % place.dtype.itemsize:  # not aligned for a view: the one copy is here
            data = data.clone()
        return data.view(place.dtype).view(place.shape)


def open_mapped(
    folder: Path, record: ShardRecord, manifest: Manifest
) -> tuple[MappedShard | None, str | None]:
    """Map a shard that :func:`~graphsplit.caching.read.audit.file_problem` passed, after
    safetensors checked its header against the manifest: the shard, or a problem."""
    try:
        with regular_files.pinned_map(folder / record.file) as (name, mapped):
            handle = safe_open(name, framework="pt", device="cpu")
            problem = shard_tensors_problem(handle, record, manifest)
    except UnsafeFileError as error:
        return None, (error.reason or str(error)).split(";")[0]
    except Exception as error:  # safetensors raises its own error types; mmap a ValueError
        return None, f"safetensors cannot open it ({error})"
    if problem is not None:
        return None, problem
    places = _layout(mapped)
    if isinstance(places, str):
        return None, places
    return MappedShard(mapped, places), None


def _layout(mapped: mmap.mmap) -> dict[str, TensorPlace] | str:
    """Each tensor's place in the file, from the safetensors header (already accepted by
    safetensors, so this only reads it; a problem if it is out of bounds after all)."""
    (length,) = struct.unpack_from("<Q", mapped, 0)
    return layout(json.loads(mapped[8 : 8 + length]), 8 + length, len(mapped))
