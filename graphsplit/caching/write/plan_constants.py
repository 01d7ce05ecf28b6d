"""Per-dataset constants per plan: one cache of several plans whose constants differ.

A per-dataset constant is frozen work that reads no batch input, so one plan computes the same
value on every batch. Its value may still depend on the plan: a frozen table sliced by a size or
by a value read off frozen data (``table[:max(lengths)]``, see docs/algorithm.md 5b) is another
tensor for each prompt length. So a cache records the constants per plan:

- ``constants.safetensors`` (``Manifest.constants``) holds the constants loader batch 0 computed,
  written by the main process as ever: a cache of one plan is what it always was;
- every other plan a process meets gets its own file, ``constants-<key>.safetensors``,
  recorded in its :class:`~graphsplit.caching.format.layout.PlanRecord` (``constants``); a
  shard holding a row of such a plan records its rows' plans
  (:func:`~graphsplit.caching.write.plan_rows.note_plan`), so no row is read with another
  plan's constants;
- a later batch of a plan already met must give the same values (else a graphsplit bug: a batch
  dim not found).

A process other than the main one does not see batch 0: it takes batch 0 to be the first plan's
(the split's), or, resuming, the plan shard 0's record names. When that guess is wrong for rows
it wrote without a record of their own, :func:`refuse_unrecorded_constants` stops the manifest
instead of letting those rows be read with another plan's constants.

In and out::

    PlanConstants(folder, header, split, finished, durable=True)
        .handle(stored, errors, batch_index, plan) -> {name: storage error} of a new plan file
        .record(key) -> ConstantsRecord | None      # the plan's own constants file, if written
    refuse_unrecorded_constants(folder, header, shards, plans, first_key)    # CacheError
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from graphsplit.caching.format.layout import (
    CacheHeader,
    ConstantsRecord,
    PlanRecord,
    ShardProgress,
    ShardRecord,
    plan_constants_file,
)
from graphsplit.caching.format.memory_order import memory_order
from graphsplit.caching.store import file_writes, remote
from graphsplit.errors import CacheError, Fix, user_error

__all__ = ["PlanConstants", "refuse_unrecorded_constants"]

NOT_A_CONSTANT_FIX = Fix(
    "compute it inside the step from the batch's own tensors (the Trainer's count: "
    "num_items_in_batch = (labels != -100).sum()), so stage 2 recomputes it from what the "
    "cache holds; or give it one value per sample (a batch dimension)"
)
BATCH_ZERO_FIX = Fix(
    "cache on one process, or put a batch of the split's own example shape first in the loader "
    "(then constants.safetensors holds the first plan's constants)"
)


class PlanConstants:
    """This process's per-dataset constants, per plan (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        header: CacheHeader,
        split: Any,
        finished: Mapping[int, ShardProgress],
        *,
        durable: bool,
    ) -> None:
        self.folder = folder
        self.header = header
        self.durable = durable
        plan_set = getattr(split, "plan_set", None)
        # The plan whose constants are constants.safetensors (batch 0's), as this process knows.
        self.base: str | None = None if plan_set is None else plan_set.first.key
        done = finished.get(0)
        if done is not None and done.shard.signatures:
            self.base = done.shard.signatures[0]
        self._values: dict[str | None, dict[str, torch.Tensor]] = {}
        self._records: dict[str, ConstantsRecord] = {}

    def handle(
        self,
        stored: Mapping[str, torch.Tensor],
        errors: Mapping[str, float],
        batch_index: int,
        plan: Any,
        write_base: Any = None,
    ) -> dict[str, float]:
        """Batch ``batch_index``'s constants (``stored``, made by ``plan``): batch 0 writes
        ``constants.safetensors`` through ``write_base(constants, errors)``; the first batch of
        another plan writes that plan's file. Returns the storage errors of a plan file
        written now (the shard adds them to its own), else nothing."""
        specs = self.header.constant_specs
        if not specs:
            return {}
        key = None if plan is None else plan.key
        constants = {spec.name: stored[spec.name] for spec in specs}
        if batch_index == 0:
            self.base = key
            write_base(constants, errors)
        known = self._values.get(key)
        if known is not None:
            for name, value in constants.items():
                if not torch.equal(value, known[name]):
                    raise user_error(
                        CacheError,
                        f"the per-dataset constant {name!r} differs between batches of one plan, "
                        "so it is not a constant: it has no batch dimension, so the cache would "
                        "store it once for the whole dataset, but it is a per-batch value (a "
                        "count of the batch's tokens handed to the step, a packed batch's "
                        "sequence offsets).",
                        fix=NOT_A_CONSTANT_FIX,
                    )
            return {}
        self._values[key] = {name: value.clone() for name, value in constants.items()}
        if key is None or key == self.base:
            return {}
        self._records[key] = self._write(key, constants)
        return {name: error for name, error in errors.items() if name in constants}

    def record(self, key: str) -> ConstantsRecord | None:
        """Plan ``key``'s own constants file, if this process wrote one."""
        return self._records.get(key)

    def _write(self, key: str, constants: Mapping[str, torch.Tensor]) -> ConstantsRecord:
        orders = {name: memory_order(value) for name, value in constants.items()}
        physical = {
            name: (value if orders[name] is None else value.permute(orders[name])).contiguous()
            for name, value in constants.items()
        }
        name = plan_constants_file(key)
        path = self.folder / name
        checksum = file_writes.save_tensors(physical, path, {"format": "pt"})
        temporary = file_writes.temporary_path(path)
        size, checksum = file_writes.commit_file(
            temporary, path, checksum=checksum, durable=self.durable
        )
        etag = remote.version(path) if isinstance(path, remote.RemotePath) else None
        return ConstantsRecord(
            file=name, checksum=checksum, bytes=size, dim_orders=orders, etag=etag
        )


def refuse_unrecorded_constants(
    folder: Path | Any,
    header: CacheHeader,
    shards: Sequence[ShardRecord],
    plans: Mapping[str, PlanRecord],
    first_key: str | None,
) -> None:
    """Every plan with rows reads its own constants file, or is batch 0's plan (whose constants
    are ``constants.safetensors``); else stop before the manifest is written."""
    if not header.constant_specs or not plans or not shards:
        return
    base = shards[0].signatures[0] if shards[0].signatures else first_key
    used = {key for shard in shards for key in (shard.signatures or (first_key,))}
    missing = sorted(
        str(key)
        for key in used
        if key != base and (key not in plans or plans[key].constants is None)
    )
    if missing:
        raise user_error(
            CacheError,
            f"the per-dataset constants of plan {', '.join(missing)} of {folder} were not "
            f"recorded: a process other than the main one took loader batch 0 to be the first "
            f"plan's, but it was plan {base}'s.",
            fix=BATCH_ZERO_FIX,
        )
