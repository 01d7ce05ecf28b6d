"""Where the batches to cache come from: the user's loader, numbered and checked.

Glossary:
    batch source: the loader seen as numbered batches; it loads only the batches a process
        computes where it can, and checks that a resumed run sees the same samples.
    position: a sample's place in the loader's order: its dataset index for a map-style
        ``DataLoader``, else the running count of samples the loader yielded.
    key: the sample's name in the cache: ``batch["key"][row]`` when the loader gives one, else
        ``str(position)``.

In and out::

    source_for(loader, input_names) -> BatchSource    # refuses shuffling and prepared loaders
        .num_samples, .num_batches (None until known)   .batch_size() -> int | None
        .count(wanted) -> samples in the wanted batches, where known in advance
        .batches(wanted, finished, batches_per_shard) -> Iterator[Batch]
        .refuse_reordered_resume(finished, batches_per_shard)
    as_mapping(batch, names) -> {name: value}         batch_keys(batch, positions) -> [key]
    unsharded_workers(source) -> int   # workers of a DataLoader over an IterableDataset
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphsplit.caching.format.layout import ShardProgress
from graphsplit.errors import CacheError, Fix, Remedy, StaleCacheError, user_error

__all__ = ["Batch", "BatchSource", "as_mapping", "batch_keys", "source_for", "unsharded_workers"]

Wanted = Callable[[int], bool]  # whether this process computes the batch of that index
Finished = Mapping[int, ShardProgress]  # the finished shards of an interrupted run, by index


@dataclass
class Batch:
    """One loader batch: its index in the loader, its samples' positions, and its data."""

    index: int
    positions: list[int]
    data: Any


class BatchSource:
    """The loader's batches, numbered; only the wanted ones are loaded where possible."""

    num_samples: int | None = None
    num_batches: int | None = None
    random_fields: tuple[str, ...] = ()  # inputs :mod:`.random_samples` saw change between reads

    def batch_size(self) -> int | None:
        raise NotImplementedError

    def count(self, wanted: Wanted) -> int | None:
        """How many samples the wanted batches hold, where known in advance."""
        return None

    def batches(self, wanted: Wanted, finished: Finished, per_shard: int) -> Iterator[Batch]:
        raise NotImplementedError

    def refuse_reordered_resume(self, finished: Finished, per_shard: int) -> None:
        """Refuse to resume when finished shards hold other positions than the loader gives."""


class IndexedSource(BatchSource):
    """A DataLoader over a map-style dataset: every batch's dataset indices are known upfront,
    so a process loads only the batches it computes, through a loader built like the user's."""

    def __init__(
        self, loader: Any, input_names: Sequence[str], index_lists: list[list[int]]
    ) -> None:
        self.loader = loader
        self.input_names = tuple(input_names)
        self.index_lists = index_lists  # the batch sampler's, read once
        self.num_batches = len(self.index_lists)
        self.num_samples = sum(len(indices) for indices in self.index_lists)

    def batch_size(self) -> int | None:
        return self.loader.batch_size or (len(self.index_lists[0]) if self.index_lists else None)

    def count(self, wanted: Wanted) -> int | None:
        return sum(len(indices) for j, indices in enumerate(self.index_lists) if wanted(j))

    def batches(self, wanted: Wanted, finished: Finished, per_shard: int) -> Iterator[Batch]:
        from torch.utils.data import DataLoader

        chosen = [j for j in range(self.num_batches) if wanted(j)]
        if not chosen:
            return
        loader = self.loader
        options: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": loader.generator,
        }
        if loader.num_workers > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        subset = DataLoader(
            loader.dataset, batch_sampler=[self.index_lists[j] for j in chosen], **options
        )
        for j, data in zip(chosen, subset):
            _refuse_rows_per_item(data, self.input_names, self.index_lists[j])
            yield Batch(j, self.index_lists[j], data)

    def refuse_reordered_resume(self, finished: Finished, per_shard: int) -> None:
        for shard, progress in finished.items():
            lists = self.index_lists[shard * per_shard : (shard + 1) * per_shard]
            expected = [position for indices in lists for position in indices]
            if list(progress.positions) != expected:
                raise _order_changed(shard)


class StreamSource(BatchSource):
    """Any other iterable of batches: every process iterates all of it and skips what it
    does not compute (loading it, but not running stage 1 on it)."""

    def __init__(self, loader: Any, input_names: Sequence[str]) -> None:
        self.loader = loader
        self.input_names = tuple(input_names)
        self._peeked: tuple[Any, Iterator[Any]] | None = None
        dataset = getattr(loader, "dataset", None)
        with contextlib.suppress(TypeError):
            self.num_samples = len(dataset) if dataset is not None else None

    def batch_size(self) -> int | None:
        if self._peeked is None:
            iterator = iter(self.loader)
            try:
                first = next(iterator)
            except StopIteration:
                raise empty_loader_error() from None
            self._peeked = (first, iterator)
        return _batch_length(self._peeked[0], self.input_names)

    def batches(self, wanted: Wanted, finished: Finished, per_shard: int) -> Iterator[Batch]:
        if self._peeked is not None:
            first, rest = self._peeked
            self._peeked = None
            iterator: Iterator[Any] = itertools.chain([first], rest)
        else:
            iterator = iter(self.loader)
        position = 0
        skipped: dict[int, list[str]] = {}
        count = 0
        for j, data in enumerate(iterator):
            size = _batch_length(data, self.input_names)
            positions = list(range(position, position + size))
            position += size
            count = j + 1
            shard = j // per_shard
            if shard in finished:
                expected = finished[shard].shard.keys
                skipped.setdefault(shard, []).extend(batch_keys(data, positions))
                if len(skipped[shard]) >= len(expected) and skipped.pop(shard) != list(expected):
                    raise _order_changed(shard)
            if wanted(j):
                yield Batch(j, positions, data)
        if skipped:
            raise _order_changed(min(skipped))
        self.num_batches = count


def source_for(loader: Any, input_names: Sequence[str]) -> BatchSource:
    """The batch source of ``loader``; refuses loaders whose order is not the same every run."""
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if type(loader).__module__.startswith("accelerate"):
        raise user_error(
            CacheError,
            "graphsplit.cache got a loader returned by accelerator.prepare, which already splits "
            "the data between processes.",
            fix=Fix(
                "pass the plain DataLoader and the accelerator: graphsplit.cache(split, loader, "
                "path, accelerator=accelerator)"
            ),
        )
    if isinstance(loader, DataLoader):
        batch_sampler = loader.batch_sampler
        samplers = {"sampler": loader.sampler}
        if batch_sampler is not None and hasattr(batch_sampler, "sampler"):
            samplers["batch sampler's sampler"] = batch_sampler.sampler  # batch_sampler=...
        unordered = {
            where: sampler
            for where, sampler in samplers.items()
            if isinstance(sampler, (RandomSampler, DistributedSampler))
        }
        if unordered:
            where, sampler = next(iter(unordered.items()))
            raise user_error(
                CacheError,
                f"the loader shuffles or splits its dataset (its {where} is a "
                f"{type(sampler).__name__}); caching needs the same order on every run and "
                "in every process.",
                fix=Fix(
                    "build the loader with shuffle=False and no sampler (shuffle the cached "
                    "dataset when training instead)"
                ),
            )
        if not isinstance(loader.dataset, IterableDataset) and batch_sampler is not None:
            index_lists = [list(indices) for indices in batch_sampler]
            if all(_is_index(i) for indices in index_lists for i in indices):
                return IndexedSource(loader, input_names, index_lists)
            # A sampler that yields the items themselves, not dataset indices (finetrainers'
            # BucketSampler, whose dataset passes them through): no index names a row, so the
            # batches are read as they come, as any iterable's are.
    return StreamSource(loader, input_names)


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def unsharded_workers(source: BatchSource) -> int:
    """The number of worker processes of a DataLoader over an IterableDataset (0 otherwise):
    each runs the dataset's own ``__iter__``, so one that ignores ``get_worker_info()`` gives
    every sample once per worker, which a repeated key reveals."""
    from torch.utils.data import DataLoader, IterableDataset

    loader = getattr(source, "loader", None)
    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        return loader.num_workers if loader.num_workers > 1 else 0
    return 0


def as_mapping(batch: Any, names: Sequence[str]) -> dict[str, Any]:
    """A batch's stage-1 inputs by name, from a dict batch, a tuple in ``names`` order, or the
    one input itself of a one-input step."""
    if isinstance(batch, Mapping):
        missing = [name for name in names if name not in batch]
        if missing:
            raise user_error(
                CacheError,
                f"the loader's batches lack {missing}; stage 1 takes {list(names)} and the batches "
                f"hold {sorted(map(str, batch))}.",
                fix=Fix("return these fields from the dataset (or the collate function)"),
            )
        return {name: batch[name] for name in names}
    if isinstance(batch, (list, tuple)) and len(batch) == len(names):
        return dict(zip(names, batch))
    if isinstance(batch, (list, tuple)) and len(names) == 1:
        # A step taking the loader's tuple whole (a webdataset's ``image, text = batch``).
        return {names[0]: batch}
    if isinstance(batch, torch.Tensor) and len(names) == 1:
        return {names[0]: batch}  # ``DataLoader(images)``: each batch the step's one input
    raise user_error(
        CacheError,
        f"a batch is a {type(batch).__name__}; graphsplit.cache needs a dict holding {list(names)} "
        "(and optionally 'key').",
        fix=Fix("make the dataset return dicts"),
    )


def empty_loader_error() -> CacheError:
    """The error for a loader that yields no batch: there is nothing to cache."""
    return user_error(
        CacheError,
        "the loader yielded no batches; there is nothing to cache",
        fix=Fix("pass a loader that yields at least one batch (is its dataset empty?)"),
    )


def batch_keys(batch: Any, positions: Sequence[int]) -> list[str]:
    """The sample keys of a batch: its ``"key"`` list, else the positions as strings."""
    raw = batch.get("key") if isinstance(batch, Mapping) else None
    if raw is None:
        return [str(position) for position in positions]
    if isinstance(raw, torch.Tensor):
        raw = raw.tolist()
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) != len(positions):
        raise user_error(
            CacheError,
            f"the batch's 'key' is {type(raw).__name__} {raw!r:.60}; it must be a list with one "
            f"key per sample ({len(positions)} here)",
            fix=Fix(
                "give each dataset item a str 'key' (default_collate batches them into a list), "
                "or leave 'key' out to number the samples"
            ),
        )
    return [str(key) for key in raw]


def _batch_length(batch: Any, names: Sequence[str]) -> int:
    # The inputs the batch holds: a missing one is refused with its own reason by stage 1.
    present = [n for n in names if n in batch] if isinstance(batch, Mapping) else names
    values = list(as_mapping(batch, present).values())
    values += [item for value in values if type(value) in (list, tuple) for item in value]
    sizes = [
        int(value.shape[0])
        for value in values
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    if isinstance(batch, Mapping) and "key" in batch:
        keys = len(batch["key"])
        if sizes and sizes[0] != keys:
            raise user_error(
                CacheError,
                f"the batch's 'key' lists {keys} key(s) but its inputs hold {sizes[0]} samples.",
                fix=Fix("give one key per sample"),
            )
        return keys
    if sizes:
        return sizes[0]
    raise user_error(
        CacheError,
        "cannot tell how many samples a batch holds: it has no 'key' list and no batched tensor "
        f"among {list(names)}.",
        fix=Fix("give each batch a 'key' list"),
    )


def _refuse_rows_per_item(batch: Any, names: Sequence[str], indices: Sequence[int]) -> None:
    """A map-style loader's samples are named by dataset index, one row each. A collate
    function that makes several rows of one item (DreamBooth's prior preservation appends each
    item's class image after the instance images) leaves rows without a name of their own."""
    values = (
        as_mapping(batch, [n for n in names if n in batch]) if isinstance(batch, Mapping) else {}
    )
    sizes = [v.shape[0] for v in values.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not sizes or len(indices) in sizes:  # an unbatched input beside batched ones is fine
        return
    rows = int(sizes[0])
    how = (
        "packs several items into a row (DataCollatorWithFlattening's packing: each cached row "
        "is then a packed row, not a sample)"
        if rows < len(indices)
        else "makes other than one row per item (as prior preservation's collate_fn does, "
        "appending class examples)"
    )
    raise user_error(
        CacheError,
        f"a batch holds {rows} rows but its sampler gave {len(indices)} dataset indices "
        f"({reprlib.repr(list(indices))}): the collate function {how}, and a DataLoader's "
        "cached rows are named by their dataset index.",
        fix=Fix(
            "if each row is a sample of its own, pass the batches as an iterable, "
            "graphsplit.cache(split, (batch for batch in loader), path): its rows are then "
            "numbered as they come and regrouped when read; if the step pairs rows by their "
            "position (DPO's [chosen; rejected]), make each item one row instead (stack its "
            "rows along a new dim in the collate function)"
        ),
    )


def _order_changed(shard: int) -> CacheError:
    return user_error(
        StaleCacheError,
        f"the loader yields other samples for shard {shard} than the interrupted run did (its "
        "order or dataset changed), so the run cannot resume.",
        fix=Fix(
            "use the same loader without shuffling, or pass {remedy} to start the cache afresh",
            Remedy.OVERWRITE,
        ),
    )
