"""Where a shard is written: stage 1 runs on each batch, its rows collect into shards, and
background threads save (and hash), fsync and rename each shard, then record it in
``.partial/``.

Glossary:
    row: one sample's slice of a boundary tensor, cut along the tensor's batch dim and stored
        as its own contiguous tensor, so samples of different shapes can share a cache. Rows
        are stored in the batch tensor's memory order (see
        :mod:`~graphsplit.caching.format.memory_order`).
    pending shard: the rows of one shard, collected in memory until its last batch is done.
    commit: a saved shard's temporary file is fsync'd (unless ``durable=False``) and renamed
        into place (its checksum was computed from memory while it was saved); its progress
        record is written after that, so a record always names a whole file, durable unless
        the run is not.
    constants: boundary tensors without a batch dim; batch 0 writes them, the first batch of
        another plan writes that plan's, later batches of a plan must compute the same values
        (:mod:`~graphsplit.caching.write.plan_constants`).

In and out::

    write_shards(split, source, folder, *, header, finished, processes, progress, durable)
        # every unfinished shard this process owns -> shard-*.safetensors + .partial/shard-*.json
    ShardWriter(folder, durable=True).submit(pending) ... .close() -> [ShardProgress]
    ShardWriter.commit(pending, temporary) -> ShardProgress      # one shard, on a thread
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphsplit.caching.format.input_digests import batch_input_digests
from graphsplit.caching.format.layout import (
    CONSTANTS_FILE,
    CONSTANTS_PROGRESS_FILE,
    PARTIAL_DIR,
    CacheHeader,
    ConstantsProgress,
    ConstantsRecord,
    ShardProgress,
    ShardRecord,
    shard_file_name,
    tensor_name,
)
from graphsplit.caching.format.memory_order import Order, memory_order
from graphsplit.caching.format.records import to_json
from graphsplit.caching.format.tensor_file import TensorBytes, rows_of
from graphsplit.caching.loader.batches import (
    BatchSource,
    as_mapping,
    batch_keys,
    unsharded_workers,
)
from graphsplit.caching.store import file_writes, remote
from graphsplit.caching.write.plan_constants import PlanConstants
from graphsplit.caching.write.plan_rows import note_plan, run_stage1
from graphsplit.caching.write.processes import Processes
from graphsplit.errors import CacheError, Fix, Remedy, user_error
from graphsplit.units import human_bytes

__all__ = ["PendingShard", "ShardWriter", "write_shards"]


@dataclass
class PendingShard:
    """The rows of one shard, collected in memory until its last batch is done."""

    index: int
    rows: dict[str, TensorBytes] = field(default_factory=dict)  # by tensor name in the file
    keys: list[str] = field(default_factory=list)
    shapes: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    orders: list[tuple[Order | None, ...]] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    # Each batch's input digests, computed on the digest thread; resolved into ``digests``.
    digesting: list[Future[list[str]]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    max_abs_error: dict[str, float] = field(default_factory=dict)
    nbytes: int = 0
    # Each row's plan (signature key) and the plans used, in a split of several plans.
    signatures: list[str] = field(default_factory=list)
    plans: dict[str, Any] = field(default_factory=dict)  # key -> PlanRecord
    # Each stage-1 batch's row count, in a cache whose stage 2 pairs rows (else None).
    batch_rows: list[int] | None = None


def write_shards(
    split: Any,
    source: BatchSource,
    folder: Path,
    *,
    header: CacheHeader,
    finished: Mapping[int, ShardProgress],
    processes: Processes,
    progress: bool | None,
    durable: bool = True,
) -> dict[int, ShardProgress]:
    """Compute and write every shard this process owns that ``finished`` does not hold
    (fsync'ing each file unless ``durable=False``).

    Returns:
        The progress record of each shard written, by shard index (also in ``.partial/``).
    """
    per_shard = header.layout.batches_per_shard

    def wanted(batch_index: int) -> bool:
        shard = batch_index // per_shard
        return processes.owns(shard) and shard not in finished

    device = _stage1_device(split.stage1, processes.accelerator)
    writer = ShardWriter(folder, durable=durable)
    # sha256 of the inputs (hashlib releases the GIL) runs beside stage 1, not after it: at
    # 1024 px fp32 it costs ~8 ms a sample, as much as a VAE encode on a GPU.
    digester = ThreadPoolExecutor(1, thread_name_prefix="graphsplit-digest")
    shown = progress if processes.is_main else False  # one bar, on the main process
    bar = _progress_bar(shown, source.count(wanted), processes)
    seen_keys: dict[str, int] = {}
    constants = PlanConstants(folder, header, split, finished, durable=durable)

    def write_base(values: Mapping[str, torch.Tensor], errors: Mapping[str, float]) -> None:
        _write_constants(folder, values, errors, durable=durable)

    pending: PendingShard | None = None
    try:
        for batch in source.batches(wanted, finished, per_shard):
            shard = batch.index // per_shard
            if pending is not None and pending.index != shard:
                writer.submit(_digested(pending))
                pending = None
            pending = pending or PendingShard(shard)
            outputs, plan = run_stage1(split, batch.data, len(batch.positions), device, header)
            stored, errors = _to_storage(outputs, header)
            own_errors = constants.handle(stored, errors, batch.index, plan, write_base)
            keys = batch_keys(batch.data, batch.positions)
            _refuse_seen_keys(keys, batch.positions, seen_keys, source)
            # A copy: the loader may refill its tensors for the next batch while they are hashed.
            inputs = _snapshot(as_mapping(batch.data, header.inputs))
            pending.digesting.append(
                digester.submit(batch_input_digests, inputs, header.inputs, len(keys))
            )
            _add_rows(pending, header, stored, errors, keys, batch.positions)
            note_plan(pending, split, plan, len(keys), constants.record)
            _add_errors(pending.max_abs_error, own_errors)
            if bar is not None:
                bar.update(len(keys))
                bar.set_postfix_str(
                    f"{human_bytes(writer.bytes_submitted + pending.nbytes)} written"
                )
        if pending is not None:
            writer.submit(_digested(pending))
        return writer.close()
    except BaseException:
        writer.close(cancel=True)
        raise
    finally:
        digester.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()


class ShardWriter:
    """Writes shards on background threads, so stage 1 keeps running meanwhile.

    One thread serialises shard ``k`` into a temporary file (hashing its bytes from memory as
    it writes them); one of two other threads commits it (:meth:`commit`: fsync, rename, then
    the progress record), so its fsync overlaps the writing of shard ``k + 1``. At most one
    shard waits in memory besides the one being filled, and at most ``_UNSYNCED_SHARDS``
    written shards wait for their fsync: the saving thread waits for the oldest before it
    hands on another, so a slow disk holds stage 1 back instead of piling up dirty pages.
    """

    def __init__(self, folder: Path, *, durable: bool = True) -> None:
        self.folder = folder
        self.durable = durable
        self.bytes_submitted = 0
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="graphsplit-save")
        # Two committers: fsyncs of consecutive shards overlap.
        self._committers = ThreadPoolExecutor(
            _UNSYNCED_SHARDS, thread_name_prefix="graphsplit-commit"
        )
        self._saving: tuple[int, Future[Future[ShardProgress]]] | None = None
        self._commits: dict[int, Future[ShardProgress]] = {}
        self._unsynced: list[Future[ShardProgress]] = []  # the saving thread's alone

    def submit(self, shard: PendingShard) -> None:
        """Queue a complete pending shard; waits while the shard before it is being saved."""
        self._collect_saving()
        self.bytes_submitted += shard.nbytes
        self._saving = (shard.index, self._saver.submit(self.save, shard))

    def wait(self) -> None:
        """Wait until every shard submitted so far is committed (a checkpoint then covers it)."""
        self._collect_saving()
        for commit in self._commits.values():
            commit.result()

    def close(self, *, cancel: bool = False) -> dict[int, ShardProgress]:
        """Wait for every shard and return their progress records by shard index (none when
        ``cancel``)."""
        try:
            self._collect_saving()
            return {index: commit.result() for index, commit in self._commits.items()}
        except BaseException:
            if not cancel:
                raise
            return {}
        finally:
            self._saver.shutdown(wait=True)
            self._committers.shutdown(wait=True)

    def save(self, shard: PendingShard) -> Future[ShardProgress]:
        """Serialise ``shard`` into its temporary file, then hand it to a committer (once
        fewer than ``_UNSYNCED_SHARDS`` earlier shards wait for theirs)."""
        name = shard_file_name(shard.index)
        # One metadata entry only: safetensors writes a dict's entries in a random order per
        # process, and resumed or multi-process runs must write byte-identical shards.
        metadata = {"graphsplit_keys": json.dumps(shard.keys)}
        checksum = file_writes.save_tensors(shard.rows, self.folder / name, metadata)
        shard.rows = {}
        temporary = file_writes.temporary_path(self.folder / name)
        self._unsynced = [commit for commit in self._unsynced if not commit.done()]
        if len(self._unsynced) >= _UNSYNCED_SHARDS:
            wait(self._unsynced, return_when=FIRST_COMPLETED)
        committing = self._committers.submit(self.commit, shard, temporary, checksum)
        self._unsynced.append(committing)
        return committing

    def commit(self, shard: PendingShard, temporary: Path, checksum: str) -> ShardProgress:
        """Move a saved shard (with the ``checksum`` its bytes had in memory) into place and
        record it in ``.partial/``."""
        name = shard_file_name(shard.index)
        size, checksum = file_writes.commit_file(
            temporary, self.folder / name, checksum=checksum, durable=self.durable
        )
        progress = ShardProgress(
            shard=ShardRecord(
                file=name,
                checksum=checksum,
                bytes=size,
                etag=_version(self.folder / name),
                keys=tuple(shard.keys),
                shapes=tuple(shard.shapes),
                row_orders=tuple(shard.orders),
                input_sha256=tuple(shard.digests),
                signatures=tuple(shard.signatures) if shard.plans else None,
                batch_rows=None if shard.batch_rows is None else tuple(shard.batch_rows),
            ),
            positions=tuple(shard.positions),
            max_abs_error=shard.max_abs_error,
            plans=shard.plans or None,
        )
        _note_progress(self.folder, progress)
        return progress

    def _collect_saving(self) -> None:
        if self._saving is not None:
            (index, saving), self._saving = self._saving, None
            self._commits[index] = saving.result()
        for commit in self._commits.values():
            if commit.done() and commit.exception() is not None:
                commit.result()


def _snapshot(value: Any) -> Any:
    """A copy of a batch's inputs for hashing later: tensors cloned (one memcpy each, where
    ``copy.deepcopy`` costs tens of microseconds more per tensor), containers rebuilt,
    immutable values shared, anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if type(value) is dict:
        return {key: _snapshot(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_snapshot(item) for item in value)
    return copy.deepcopy(value)


# Written shards that may wait for their fsync at once (each on its own committer thread).
# The fsync of shard k overlaps the writing of shard k + 1: 1 GiB in 256 MiB shards, Linux
# 6.18 in a VM, 9 alternations: 630 ms wall against 869 ms when each shard was fsync'd before
# the next was written, the same CPU time (566 against 545 ms); see docs/benchmarks.md.
_UNSYNCED_SHARDS = 2


def _digested(shard: PendingShard) -> PendingShard:
    """``shard`` with the input digests of all its batches (waiting for the last ones)."""
    shard.digests = [digest for batch in shard.digesting for digest in batch.result()]
    shard.digesting = []
    return shard


def _to_storage(
    outputs: Mapping[str, torch.Tensor], header: CacheHeader
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Cast to the storage dtypes (measuring the error) and move to the CPU."""
    stored: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    with torch.inference_mode():
        for spec in header.boundary:
            value = outputs[spec.name]
            dtype = header.stored_dtype(spec)
            if value.dtype != dtype:
                value, errors[spec.name] = _cast(value, dtype, spec.name)
            stored[spec.name] = value.to("cpu")
    return stored, errors


def _cast(value: torch.Tensor, dtype: torch.dtype, name: str) -> tuple[torch.Tensor, float]:
    """``value`` in ``dtype`` and the largest absolute error the cast introduced."""
    stored = value.to(dtype)
    back = stored.to(value.dtype)
    finite = torch.isfinite(value)
    if not bool(torch.isfinite(back)[finite].all()):
        largest = float(value[finite].abs().max())
        raise user_error(
            CacheError,
            f"{name!r} holds values up to {largest:.4g}, beyond the range of {dtype}.",
            fix=Fix(
                "use {remedy} (same range as float32), or store losslessly",
                Remedy.STORE_BFLOAT16,
            ),
        )
    if value.numel() == 0:
        return stored, 0.0
    return stored, float((back - value).abs().masked_fill(~finite, 0).max())


def _add_errors(into: dict[str, float], errors: Mapping[str, float]) -> None:
    """The largest storage error per tensor."""
    for name, error in errors.items():
        into[name] = max(into.get(name, 0.0), error)


def _write_constants(
    folder: Path,
    constants: Mapping[str, torch.Tensor],
    errors: Mapping[str, float],
    *,
    durable: bool,
) -> None:
    orders = {name: memory_order(value) for name, value in constants.items()}
    physical = {
        name: (value if orders[name] is None else value.permute(orders[name])).contiguous()
        for name, value in constants.items()
    }
    path = folder / CONSTANTS_FILE
    checksum = file_writes.save_tensors(physical, path, {"format": "pt"})
    temporary = file_writes.temporary_path(path)
    size, checksum = file_writes.commit_file(temporary, path, checksum=checksum, durable=durable)
    record = ConstantsRecord(
        file=CONSTANTS_FILE, checksum=checksum, bytes=size, dim_orders=orders, etag=_version(path)
    )
    errors = {name: error for name, error in errors.items() if name in constants}
    _note_progress(folder, ConstantsProgress(constants=record, max_abs_error=errors))


def _version(path: Path) -> str | None:
    """The version (ETag) an object store gave a file just uploaded, for the manifest's record
    (readers refuse another: see caching.store.pinned_object); None for a local file."""
    return remote.version(path) if isinstance(path, remote.RemotePath) else None


def _note_progress(folder: Path, progress: ShardProgress | ConstantsProgress) -> None:
    """Record a finished shard or constants file in ``.partial/`` (after its file's rename),
    as :func:`~graphsplit.caching.format.layout.write_progress` does but without fsyncs.

    A record is a hint, never trusted: resuming reads it back and checks the file it names
    (size and checksum) first, and a missing or damaged record only means redoing that file.
    So a power cut may lose it, and the writer does not pay a journal commit per shard. The
    cache itself stays durable (unless written with ``durable=False``): each file is fsync'd
    before its rename, the folder before the manifest, and the manifest is written durably.
    """
    if isinstance(progress, ShardProgress):
        name = Path(progress.shard.file).with_suffix(".json").name
    else:
        name = CONSTANTS_PROGRESS_FILE
    file_writes.real_folder(folder / PARTIAL_DIR, create=True)
    data = json.dumps(to_json(progress)).encode()
    file_writes.write_atomically(folder / PARTIAL_DIR / name, data, durable=False)


def _add_rows(
    pending: PendingShard,
    header: CacheHeader,
    stored: Mapping[str, torch.Tensor],
    errors: Mapping[str, float],
    keys: Sequence[str],
    positions: Sequence[int],
) -> None:
    # Rows are stored in the batch tensor's memory order, as slices of the memory of one
    # batch-major copy per tensor: one copy per batch, none at all for the usual layouts.
    columns = []
    for spec in header.sample_specs:
        assert spec.batch_dim is not None
        value = stored[spec.name]
        order = memory_order(value)
        physical = value if order is None else value.permute(order)
        position = spec.batch_dim if order is None else order.index(spec.batch_dim)
        row_shape = tuple(size for d, size in enumerate(value.shape) if d != spec.batch_dim)
        columns.append((spec.name, physical.movedim(position, 0).contiguous(), row_shape, order))
    orders = tuple(order for _, _, _, order in columns)
    shapes = tuple(row_shape for _, _, row_shape, _ in columns)
    first = len(pending.keys)
    for name, values, _, _ in columns:
        for offset, row in enumerate(rows_of(values)):  # slices of one buffer: no torch calls
            pending.rows[tensor_name(first + offset, name)] = row
        pending.nbytes += values.numel() * values.element_size()
    pending.keys.extend(keys)
    if header.paired_rows is not None and keys:  # stage 2 reads this batch back whole
        pending.batch_rows = [*(pending.batch_rows or []), len(keys)]
    pending.shapes.extend([shapes] * len(keys))
    pending.orders.extend([orders] * len(keys))
    pending.positions.extend(int(position) for position in positions)
    for spec in header.sample_specs:
        if spec.name in errors:
            error = max(pending.max_abs_error.get(spec.name, 0.0), errors[spec.name])
            pending.max_abs_error[spec.name] = error


def _refuse_seen_keys(
    keys: Sequence[str], positions: Sequence[int], seen: dict[str, int], source: BatchSource
) -> None:
    for key, position in zip(keys, positions):
        if key in seen:
            workers = unsharded_workers(source)
            cause = (
                f" The loader runs {workers} workers over an IterableDataset: each worker "
                "iterates the whole dataset unless its __iter__ gives every worker its own "
                "samples."
                if workers
                else ""
            )
            fix = (
                "shard the IterableDataset by worker in its __iter__ (torch.utils.data."
                "get_worker_info(): start at info.id, step by info.num_workers) or use "
                "num_workers=0, and rerun with {remedy}"
                if workers
                else "give every sample a unique 'key' and rerun with {remedy}"
            )
            raise user_error(
                CacheError,
                f"the loader gave the sample key {key!r} twice (positions {seen[key]} and "
                f"{position}).{cause}",
                fix=Fix(fix, Remedy.OVERWRITE),
            )
        seen[key] = position


def _stage1_device(stage1: torch.nn.Module, accelerator: Any) -> torch.device | None:
    for tensor in itertools.chain(stage1.parameters(), stage1.buffers()):
        return tensor.device
    return None if accelerator is None else accelerator.device


def _progress_bar(enabled: bool | None, total: int | None, processes: Processes) -> Any:
    if enabled is False:
        return None
    from tqdm.auto import tqdm

    description = "caching" if processes.world == 1 else f"caching (process 0 of {processes.world})"
    return tqdm(
        total=total,
        desc=description,
        unit="sample",
        disable=None if enabled is None else not enabled,
        dynamic_ncols=True,
    )
