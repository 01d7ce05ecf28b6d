"""A shard on an object store, read by byte ranges: its header once, then one range per tensor.

What ``safe_open`` gives for a local file, for a
:class:`~graphsplit.caching.store.remote.RemotePath`: the same names, dtypes, shapes and metadata
(so :func:`~graphsplit.caching.read.audit. shard_tensors_problem` checks a remote shard against the
manifest exactly as a local one), read with two small ranged requests; each tensor is then one more
request. Nothing is unpickled: the header is bounded JSON, the tensors raw bytes.

In and out::

    RangedShard(path, size)          # reads and checks the header; CacheError if malformed
        .keys()  .metadata()  .get_slice(name).get_dtype() / .get_shape()
        .get_tensor(name) -> Tensor  # one ranged request, a fresh tensor (not a view)
"""

from __future__ import annotations

import json
import struct

import torch

from graphsplit.caching.format.records import DAMAGED_FILE_FIX
from graphsplit.caching.format.tensor_file import SAFETENSORS_DTYPES, TensorPlace, layout
from graphsplit.caching.store import remote
from graphsplit.caching.store.remote import RemotePath
from graphsplit.errors import CacheError, user_error

__all__ = ["RangedShard"]

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header


class _Slice:
    """What ``safe_open(...).get_slice(name)`` answers about a tensor, without its bytes."""

    def __init__(self, place: TensorPlace) -> None:
        self._place = place

    def get_dtype(self) -> str:
        return SAFETENSORS_DTYPES[self._place.dtype]

    def get_shape(self) -> list[int]:
        return list(self._place.shape)


class RangedShard:
    """A safetensors file on an object store (see the module docstring)."""

    def __init__(self, path: RemotePath, size: int) -> None:
        """Read and check the header of the ``size``-byte object ``path``.

        Raises:
            CacheError: a malformed header; StorageError: the store failed the request.
        """
        self.path = path
        if size < 8:
            raise user_error(
                CacheError,
                f"{path} has {size} bytes, too few for a safetensors file",
                fix=DAMAGED_FILE_FIX,
            )
        (length,) = struct.unpack("<Q", remote.read_range(path, 0, 8))
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise user_error(
                CacheError,
                f"{path} declares a {length}-byte header in a {size}-byte file",
                fix=DAMAGED_FILE_FIX,
            )
        try:
            header = json.loads(remote.read_range(path, 8, 8 + length))
        except (ValueError, RecursionError) as error:
            raise user_error(
                CacheError, f"{path} has a header that is not JSON ({error})", fix=DAMAGED_FILE_FIX
            ) from None
        places = layout(header, 8 + length, size)
        if isinstance(places, str):
            raise user_error(CacheError, f"{path}: {places}", fix=DAMAGED_FILE_FIX)
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise user_error(
                CacheError, f"{path} has metadata that is not a JSON object", fix=DAMAGED_FILE_FIX
            )
        self._places = places
        self._metadata = {str(key): str(value) for key, value in metadata.items()}

    def keys(self) -> list[str]:
        return list(self._places)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._places[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, read with one ranged request (KeyError if there is none)."""
        place = self._places[name]
        data = bytearray(remote.read_range(self.path, place.start, place.end))
        if not data:
            return torch.empty(place.shape, dtype=place.dtype)
        return torch.frombuffer(data, dtype=place.dtype).reshape(place.shape)
