"""A file of a remote cache, read by byte ranges: its header once, then one range per tensor.

What :class:`~graphsplit.caching.store.mapped.MappedShard` gives for a local file, for a
:class:`~graphsplit.caching.store.remote.RemotePath`: the same checked tensor table (the one
strict parser and place check, :mod:`graphsplit.caching.format.tensor_places`), so a remote
shard is accepted or refused exactly as a local one. Every read goes through one
:class:`~graphsplit.caching.store.pinned_object.PinnedObject`: the checksum (when asked), the
header and each tensor come from the version of the object the manifest recorded. Nothing is
unpickled: the header is bounded JSON, the tensors raw bytes.

In and out::

    open_ranged(path, record, *, checksum) -> RangedShard | problem (str)
    RangedShard.table  .keys()  .metadata()
    RangedShard.get_tensor(name) -> Tensor  # one ranged request, a fresh tensor (not a view)
"""

from __future__ import annotations

import torch

from graphsplit.caching.format.checksums import algorithm_of
from graphsplit.caching.format.layout import FileRecord
from graphsplit.caching.format.strict_header import HeaderProblem
from graphsplit.caching.format.tensor_places import TensorTable, read_table
from graphsplit.caching.store.pinned_object import PinnedObject, open_pinned
from graphsplit.caching.store.remote import RemotePath

__all__ = ["RangedShard", "open_ranged"]


class RangedShard:
    """A checked safetensors file on an object store (see the module docstring)."""

    def __init__(self, source: PinnedObject, table: TensorTable) -> None:
        self.path = source.path
        self.table = table
        self._source = source

    def keys(self) -> list[str]:
        return self.table.keys()

    def metadata(self) -> dict[str, str]:
        return self.table.metadata()

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, read with one ranged request (KeyError if there is none).

        Raises:
            CorruptCacheError: the object changed since it was opened; StorageError.
        """
        place = self.table.places[name]
        data = bytearray(self._source.read(place.start, place.end))
        if not data:
            return torch.empty(place.shape, dtype=place.dtype)
        return torch.frombuffer(data, dtype=place.dtype).reshape(place.shape)


def open_ranged(path: RemotePath, record: FileRecord, *, checksum: bool) -> RangedShard | str:
    """Open ``path`` pinned to ``record``'s version, checksum it through that open when
    ``checksum``, and read and check its header: the shard, or a problem in words."""
    source = open_pinned(path, record)
    if isinstance(source, str):
        return source
    if checksum:
        algorithm = algorithm_of(record.checksum)
        if source.checksum(algorithm) != record.checksum:
            return f"its {algorithm} checksum differs from the manifest's (the bytes changed)"
    table = read_table(source.read, record.bytes)
    if isinstance(table, HeaderProblem):
        return table.reason
    return RangedShard(source, table)
