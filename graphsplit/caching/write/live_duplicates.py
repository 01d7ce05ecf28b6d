"""Rows two processes of a live cache both wrote: kept once, in the first shard that holds them.

Under ``accelerate launch`` a prepared loader pads the last batches of the shorter processes
with samples another process also gets (``even_batches``; a ``DistributedSampler`` pads the
same way), and each process writes the rows it computes without asking the others. Before the
manifest is written, every key must be in one shard: a later shard holding a key already kept
is rewritten without that row (its inputs must hash the same, else the data changed between
processes), and a shard left with no row is removed.

In and out::

    drop_repeated_rows(folder, header, shards, *, durable) -> shards   # [(index, ShardProgress)]
    part_of_paired_batch(folder, header, known, size) -> CacheError    # a live batch in part known

In a cache whose stage 2 pairs rows by position (``header.paired_rows``) a stage-1 batch is
kept or dropped whole: a batch repeated in part, or given in part again, is refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from safetensors import safe_open

from graphsplit.caching.format.layout import (
    PARTIAL_DIR,
    CacheHeader,
    ShardProgress,
    ShardRecord,
    shard_progress_name,
    tensor_name,
)
from graphsplit.caching.store import file_writes
from graphsplit.caching.write.shards import _note_progress
from graphsplit.errors import CacheError, Fix, Remedy, StaleCacheError, user_error

__all__ = ["drop_repeated_rows", "part_of_paired_batch"]

Shards = list[tuple[int, ShardProgress]]


def drop_repeated_rows(
    folder: Path, header: CacheHeader, shards: Shards, *, durable: bool
) -> Shards:
    """``shards`` (by index, in order) with every key in the first shard that holds it."""
    seen: dict[str, str] = {}
    kept: Shards = []
    for index, progress in shards:
        record = progress.shard
        rows = []
        for row, (key, digest) in enumerate(zip(record.keys, record.input_sha256)):
            if key not in seen:
                seen[key] = digest
                rows.append(row)
            elif seen[key] != digest:
                raise user_error(
                    StaleCacheError,
                    f"two processes cached the sample key {key!r} from other inputs "
                    f"({record.file} and an earlier shard of {folder}).",
                    fix=Fix(
                        "give every sample a unique 'key' and the same data in every process, "
                        "then pass {remedy} to write the cache afresh",
                        Remedy.OVERWRITE,
                    ),
                )
        batch_rows = _whole_batches(folder, header, record, rows)
        if len(rows) == len(record.keys):
            kept.append((index, progress))
        elif not rows:
            file_writes.remove(folder / record.file)
            file_writes.remove(folder / PARTIAL_DIR / shard_progress_name(index))
        else:
            rewritten = _rewritten(folder, header, progress, rows, batch_rows, durable=durable)
            kept.append((index, rewritten))
    return kept


def _whole_batches(
    folder: Path, header: CacheHeader, record: ShardRecord, rows: Sequence[int]
) -> tuple[int, ...] | None:
    """The row counts of the stage-1 batches of ``record`` whose ``rows`` are kept, in a paired
    cache (None in an ordinary one); a batch kept in part is refused: its rows pair by position."""
    if record.batch_rows is None:
        return None
    kept, counts, start = set(rows), [], 0
    for count in record.batch_rows:
        left = sum(row in kept for row in range(start, start + count))
        if left not in (0, count):
            assert header.paired_rows is not None
            raise user_error(
                CacheError,
                f"{count - left} of the {count} rows of a stage-1 batch in {record.file} of "
                f"{folder} were also cached by another process, the others not; "
                f"{header.paired_rows.describe()}, so the cache keeps each batch whole.",
                fix=Fix(
                    "give every process whole batches of its own (accelerate's "
                    "even_batches=False, or a dataset whose length is a multiple of the "
                    "processes' batch size), then pass {remedy} to write the cache afresh",
                    Remedy.OVERWRITE,
                ),
            )
        if left:
            counts.append(count)
        start += count
    return tuple(counts)


def _rewritten(
    folder: Path,
    header: CacheHeader,
    progress: ShardProgress,
    rows: Sequence[int],
    batch_rows: tuple[int, ...] | None,
    *,
    durable: bool,
) -> ShardProgress:
    """The shard holding only ``rows`` (renumbered from 0), written over the old file."""
    record = progress.shard
    path = folder / record.file
    names = [spec.name for spec in header.sample_specs]
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        tensors = {
            tensor_name(new, name): handle.get_tensor(tensor_name(old, name))
            for new, old in enumerate(rows)
            for name in names
        }
    keys = [record.keys[row] for row in rows]
    checksum = file_writes.save_tensors(tensors, path, {"graphsplit_keys": json.dumps(keys)})
    temporary = file_writes.temporary_path(path)
    size, checksum = file_writes.commit_file(temporary, path, checksum=checksum, durable=durable)
    signatures = record.signatures
    shard = dataclasses.replace(
        record,
        checksum=checksum,
        bytes=size,
        keys=tuple(keys),
        shapes=tuple(record.shapes[row] for row in rows),
        row_orders=tuple(record.row_orders[row] for row in rows),
        input_sha256=tuple(record.input_sha256[row] for row in rows),
        signatures=None if signatures is None else tuple(signatures[row] for row in rows),
        batch_rows=batch_rows,
    )
    positions = tuple(progress.positions[row] for row in rows)
    rewritten = dataclasses.replace(progress, shard=shard, positions=positions)
    _note_progress(folder, rewritten)
    return rewritten


def part_of_paired_batch(folder: Path, header: CacheHeader, known: int, size: int) -> CacheError:
    """The error for a batch of a paired split holding keys the cache has and new ones."""
    assert header.paired_rows is not None
    return user_error(
        CacheError,
        f"{known} of the batch's {size} sample keys are already in the live cache at {folder}, "
        f"the others are new; {header.paired_rows.describe()}, so the cache keeps each "
        "stage-1 batch whole and cannot store part of one.",
        fix=Fix(
            "cache every batch of one pass over the data in one run (an interrupted pass "
            "resumes with the same batches), or pass {remedy} to start the cache afresh",
            Remedy.OVERWRITE,
        ),
    )
