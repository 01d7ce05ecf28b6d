"""Whether a cache holds the samples the loader yields now: their keys and input digests.

A rerun on a complete cache, and a resumed run on the shards an interrupted one finished,
compare each cached sample's key and input digest (sha256 of its stage-1 inputs, recorded per
sample in the shard records) with the loader's. That reads those samples from the loader once
more and hashes them (no stage 1): the price of never serving a cache of renamed or changed
samples.

Glossary:
    sample changes: the keys whose inputs changed, the keys the loader has and the cache lacks
        (new), and the cached keys the loader no longer has (gone). A renamed sample is one
        new and one gone key.

In and out::

    loader_samples(source, shards, per_shard, names) -> {shard: [(key, digest)]}
    SampleChanges.between(cached_rows, loader_rows) -> SampleChanges   (.empty, str())
    describe_changes(changed=, added=, missing=, removed=) -> str     # for error messages
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from graphsplit.caching.format.input_digests import batch_input_digests
from graphsplit.caching.format.layout import ShardRecord
from graphsplit.caching.loader.batches import BatchSource, as_mapping, batch_keys
from graphsplit.units import some_keys

__all__ = ["SampleChanges", "describe_changes", "loader_samples", "merge", "record_samples"]

Row = tuple[str, str]  # (key, input digest)


def loader_samples(
    source: BatchSource, wanted: Callable[[int], bool], per_shard: int, names: Sequence[str]
) -> dict[int, list[Row]]:
    """The key and input digest of every sample of the wanted shards, as the loader yields
    them now (shard ``k`` holds batches ``k * per_shard`` up to the next multiple)."""
    rows: dict[int, list[Row]] = {}
    for batch in source.batches(lambda j: wanted(j // per_shard), {}, per_shard):
        keys = batch_keys(batch.data, batch.positions)
        digests = batch_input_digests(as_mapping(batch.data, names), names, len(keys))
        rows.setdefault(batch.index // per_shard, []).extend(zip(keys, digests))
    return rows


def record_samples(record: ShardRecord) -> list[Row]:
    """The key and input digest of every sample of a shard record."""
    return list(zip(record.keys, record.input_sha256))


@dataclass(frozen=True)
class SampleChanges:
    """How the loader's samples differ from the cached ones (see the module glossary)."""

    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    moved: tuple[str, ...] = ()

    @classmethod
    def between(cls, cached: Iterable[Row], loader: Iterable[Row]) -> SampleChanges:
        before, now = dict(cached), dict(loader)
        return cls(
            changed=tuple(key for key, digest in now.items() if before.get(key, digest) != digest),
            added=tuple(key for key in now if key not in before),
            removed=tuple(key for key in before if key not in now),
        )

    @property
    def empty(self) -> bool:
        return not (self.changed or self.added or self.removed or self.moved)

    def __str__(self) -> str:
        return describe_changes(
            changed=self.changed, added=self.added, removed=self.removed, moved=self.moved
        )


def describe_changes(
    *,
    changed: Sequence[str] = (),
    added: Sequence[str] = (),
    missing: Sequence[str] = (),
    removed: Sequence[str] = (),
    moved: Sequence[str] = (),
) -> str:
    """One clause per kind of change, naming the first few keys of each."""
    parts = []
    if changed:
        parts.append(f"{len(changed)} sample(s) changed ({some_keys(changed)})")
    if added:
        parts.append(f"{len(added)} sample(s) are new ({some_keys(added)})")
    if missing:
        listed = some_keys(missing)
        parts.append(f"{len(missing)} expected sample(s) are not in the cache ({listed})")
    if removed:
        parts.append(f"{len(removed)} cached sample(s) are no longer there ({some_keys(removed)})")
    if moved:
        parts.append(f"{len(moved)} sample(s) moved to another shard ({some_keys(moved)})")
    return "; ".join(parts)


def merge(changes: Mapping[int, SampleChanges]) -> SampleChanges:
    """The changes of several shards as one; a key new in one shard and gone from another
    moved (the loader's order changed)."""
    added = [key for change in changes.values() for key in change.added]
    removed = [key for change in changes.values() for key in change.removed]
    moved = set(added) & set(removed)
    return SampleChanges(
        changed=tuple(key for change in changes.values() for key in change.changed),
        added=tuple(key for key in added if key not in moved),
        removed=tuple(key for key in removed if key not in moved),
        moved=tuple(key for key in removed if key in moved),
    )
