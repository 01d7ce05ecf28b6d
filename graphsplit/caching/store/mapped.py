"""A local file of a cache as views of its memory map, so reading an item copies nothing.

``safe_open(...).get_tensor`` copies each row out of the file's map, and :func:`collate` then
copies it again into the batch. Here an item's tensors are views of a private (copy-on-write)
map of the shard, so the batch's ``torch.stack`` is the only copy; the page cache is read in
place.

Glossary:
    mapped shard: a file opened once (``O_NOFOLLOW``, a regular file of the recorded size),
        mapped once, its checksum computed from that map when asked (so the bytes checked are
        the bytes read: a file renamed over it afterwards changes nothing), and its header
        read from the map by the one strict parser every reader uses
        (:mod:`graphsplit.caching.format.tensor_places`); :meth:`MappedShard.get_tensor`
        returns a view.

In and out::

    open_mapped(path, record, *, checksum) -> MappedShard | problem (str)
    MappedShard.table  .keys()  .metadata()
    MappedShard.get_tensor(name) -> Tensor        # a view of the map (cloned if misaligned)

The views share memory with each other and with the map: writing into an item changes this
process's copy of the page only (never the file), and the same row read again sees the change.
A file rewritten in place (not renamed over) while mapped is not detected: no reader that maps
can; graphsplit itself never writes a published file in place.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from graphsplit.caching.format.checksums import Running, algorithm_of
from graphsplit.caching.format.layout import FileRecord
from graphsplit.caching.format.strict_header import HeaderProblem
from graphsplit.caching.format.tensor_places import TensorTable, read_table
from graphsplit.caching.store import regular_files
from graphsplit.errors import UnsafeFileError

__all__ = ["MappedShard", "open_mapped"]


class MappedShard:
    """The tensors of one file as views of its memory map (see the module docstring)."""

    def __init__(self, mapped: mmap.mmap, table: TensorTable) -> None:
        # frombuffer keeps ``mapped`` alive as long as any view of it is.
        self._bytes = torch.frombuffer(mapped, dtype=torch.uint8)
        self.table = table

    def keys(self) -> list[str]:
        return self.table.keys()

    def metadata(self) -> dict[str, str]:
        return self.table.metadata()

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of the map (KeyError if the shard has no such tensor)."""
        place = self.table.places[name]
        data = self._bytes[place.start : place.end]
        if place.start % place.dtype.itemsize:  # not aligned for a view: the one copy is here
            data = data.clone()
        return data.view(place.dtype).view(place.shape)


def open_mapped(path: Path, record: FileRecord, *, checksum: bool) -> MappedShard | str:
    """Open and map ``path`` once; check its size, its checksum (when ``checksum``) and its
    header from that one map: the shard, or a problem in words."""
    try:
        with regular_files.pinned_map(path) as (_, mapped):
            pass
    except UnsafeFileError as error:
        return "it " + (error.reason or str(error)).split(";")[0].removeprefix(f"{path} ")
    except FileNotFoundError:
        return "the file is missing"
    except ValueError:  # mmap refuses an empty file
        return f"it has 0 bytes, the manifest records {record.bytes:,}"
    except OSError as error:
        return f"the file cannot be read ({error.strerror or error})"
    if len(mapped) != record.bytes:
        return f"it has {len(mapped):,} bytes, the manifest records {record.bytes:,}"
    if checksum:
        algorithm = algorithm_of(record.checksum)
        running = Running(algorithm)
        running.update(mapped)
        if running.checksum() != record.checksum:
            return f"its {algorithm} checksum differs from the manifest's (the bytes changed)"
    table = read_table(lambda start, end: mapped[start:end], len(mapped))
    if isinstance(table, HeaderProblem):
        return table.reason
    return MappedShard(mapped, table)
