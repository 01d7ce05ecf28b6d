"""The first epoch of :func:`graphsplit.integrations.transformers.split_trainer` with
``cache_while_training=True``: the rows the trainer's dataloader reads, and the callback that
drives the :class:`~graphsplit.LiveCache` from the trainer's events.

Epoch 1 reads raw dataset items (with their index: the sample key); a checkpoint commits the
rows computed so far; the end of an epoch not cut short finishes the cache, and from then on
the same dataset object serves each index's cached rows. Apart from the integration so that
its module keeps one job: training from a cache that exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset
from transformers import TrainerCallback

from graphsplit.caching import CachedDataset
from graphsplit.caching.live import LiveCache
from graphsplit.errors import CacheError, Fix, user_error
from graphsplit.integrations.trainer_checks import refuse_several_shapes

__all__ = ["LiveCacheSteps", "LiveRows", "RawItem"]


@dataclass(frozen=True)
class RawItem:
    index: int
    item: Any


class LiveRows(Dataset):
    """Index ``i``: dataset item ``i`` with its index while the live cache is being written
    (epoch 1), then sample ``i``'s cached rows (the cache names it ``str(i)``).

    The switch is read when an epoch's iteration starts (workers copy the dataset then)."""

    def __init__(self, live: LiveCache, size: int, *, grouped: bool = False) -> None:
        self.live = live
        self.size = size
        self.grouped = grouped  # padding groups: the cache holds several shapes by design
        self.raw: Any = None  # the trainer's raw dataset, set by the dataloader
        self.cached: CachedDataset | None = None
        self.rows: dict[str, int] = {}
        if live.complete:
            self.switch()

    def switch(self, cached: CachedDataset | None = None) -> None:
        """From now on: the cached rows (every sample's, else refused); ``cached``: the finished
        cache already open (reading its manifest again costs a tiny epoch a few percent)."""
        cached = self.live.dataset() if cached is None else cached
        rows = {key: index for index, key in enumerate(cached.keys)}
        missing = [index for index in range(self.size) if str(index) not in rows]
        if missing:
            raise user_error(
                CacheError,
                f"the cache at {self.live.path} lacks {len(missing)} of the {self.size} "
                f"samples (dataset indices {missing[:5]}...) after the first epoch: it was "
                "resumed from a checkpoint whose rows were not committed to this folder.",
                fix=Fix(
                    "resume with the cache folder the checkpoint was trained with, or start "
                    "afresh with overwrite=True and a new output_dir"
                ),
            )
        self.cached, self.rows = cached, rows

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        if self.cached is None:
            return RawItem(index, self.raw[index])
        return self.cached[self.rows[str(index)]]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "live": None}  # spawned workers need no writer


class LiveCacheSteps(TrainerCallback):
    """Drives a live cache from the trainer's events: a checkpoint commits the rows computed
    so far; the end of an epoch not cut short finishes the cache (every process; later epochs
    read it); the end of training before that commits and closes (a resumed run continues)."""

    def __init__(self, rows: LiveRows) -> None:
        self.rows = rows

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rows.live.commit()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The trainer sets state.epoch to epoch + (step + 1) / steps_in_epoch at every step: a
        # whole number at an epoch's last batch, a fraction where max_steps or a callback cut
        # it short (the cache then stays open for a resume).
        live = self.rows.live
        whole = state.epoch is not None and float(state.epoch).is_integer()
        if self.rows.cached is None and whole:
            live.finish()
            cached = live.dataset()
            if not self.rows.grouped:
                refuse_several_shapes(cached)
            self.rows.switch(cached)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.rows.live.complete:
            self.rows.live.commit()
            self.rows.live.close()
