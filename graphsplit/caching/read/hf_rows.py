"""Rows of an exported Hugging Face dataset, read back as cache items, strictly.

A dataset from the Hub is untrusted: a column may hold floats where the export record says
int64 rows, a row may be ragged, of the wrong rank or missing, the memory-order column may not
be JSON. Each is refused with a :class:`~graphsplit.errors.CorruptCacheError` naming the row's
key, the column and the fix, never converted with a loss (a float row read as int64 would be
truncated silently) and never a raw ``ValueError`` / ``JSONDecodeError``.

A conversion costs nothing extra when the column already has the exported dtype (the usual
case: ``datasets`` keeps the features); only a column of another dtype (a streamed dataset
without features gives Python numbers) is cast, and then checked to round-trip exactly.

In and out::

    HFCachedDataset(dataset, split=None)    map-style; item i -> CachedSample; len; keys
    HFCachedIterable(dataset, split=None)   for a streamed datasets.IterableDataset
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from graphsplit.caching.format.fingerprint import fingerprint, in_terms_of
from graphsplit.caching.format.layout import CacheHeader
from graphsplit.caching.read.collation import CachedSample, Collation, padded_dims
from graphsplit.caching.read.hf_record import (
    KEY_COLUMN,
    ORDERS_COLUMN,
    arrow_dtype,
    export_record,
    valid_order,
)
from graphsplit.caching.read.stale_split import refuse_other_split
from graphsplit.errors import CorruptCacheError, Fix, ManifestError, user_error

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["HFCachedDataset", "HFCachedIterable"]

_DOWNLOAD_AGAIN_FIX = Fix(
    "download or export the dataset again (graphsplit export); a dataset edited after the "
    "export (map, cast) is not a cache any more"
)


def _leaf_dtype(feature: Any) -> str | None:
    """The value type at the bottom of a (nested list) feature, as ``datasets`` names it."""
    while hasattr(feature, "feature"):
        feature = feature.feature
    return getattr(feature, "dtype", None)


class _Rows:
    """Turns rows of an exported dataset into :class:`CachedSample` items collate batches."""

    def __init__(self, dataset: Any, split: Split | None) -> None:
        self.record = export_record(dataset)
        header = self.record.header
        features = getattr(dataset, "features", None) or {}
        names = set(getattr(dataset, "column_names", None) or features)
        missing = [spec.name for spec in header.sample_specs if spec.name not in names]
        if missing:
            raise user_error(
                ManifestError,
                f"the dataset lacks the column(s) {missing} that its export record lists.",
                fix=Fix(
                    "keep every column of the exported dataset (drop none with select_columns / "
                    "remove_columns)"
                ),
            )
        for spec in header.sample_specs:
            expected = arrow_dtype(header.stored_dtype(spec))
            found = _leaf_dtype(features[spec.name]) if spec.name in features else None
            if found is not None and found != expected:
                raise user_error(
                    CorruptCacheError,
                    f"the dataset's column {spec.name!r} holds {found} values, but its export "
                    f"record stores that row as {header.stored_dtype(spec)} (exported as "
                    f"{expected}); graphsplit does not convert rows with a loss.",
                    fix=_DOWNLOAD_AGAIN_FIX,
                )
        if split is not None:
            current = in_terms_of(fingerprint(split, allow_meta=True), header.fingerprint, split)
            paired = getattr(split, "paired_rows", None)
            refuse_other_split(_HeaderOnly(header), current, Path("<the datasets dataset>"), paired)
        self.specs = {spec.name: spec for spec in header.sample_specs}
        self.stored = {spec.name: header.stored_dtype(spec) for spec in header.sample_specs}
        self.collation = Collation(
            path=Path("<datasets>"),
            rows=tuple((spec.name, spec.batch_dim, spec.dtype) for spec in header.sample_specs),
            constants=self.record.constants,
            order=tuple(spec.name for spec in header.boundary),
            padded=padded_dims(header.sample_specs),
        )

    def item(self, row: Mapping[str, Any]) -> CachedSample:
        key = row.get(KEY_COLUMN)
        key = key.item() if isinstance(key, np.generic) else key  # numpy format: np.str_
        if not isinstance(key, str):
            raise user_error(
                CorruptCacheError,
                f"a row of the dataset has the key {key!r}, not a string.",
                fix=_DOWNLOAD_AGAIN_FIX,
            )
        item = CachedSample(key=key)
        item.collation = self.collation
        for name, dtype in self.stored.items():
            array = self._array(key, name, row.get(name))
            if not (array.flags.owndata and array.flags.writeable):
                array = array.copy()  # a view of the dataset's memory: the item is its own
            item[name] = torch.from_numpy(array).to(dtype)
        text = row.get(ORDERS_COLUMN)
        if text:
            item.dim_orders = self._orders(key, text)
        return item

    def _array(self, key: str, name: str, value: Any) -> np.ndarray:
        spec = self.specs[name]
        target = np.dtype(arrow_dtype(self.stored[name]))

        def refuse(problem: str) -> CorruptCacheError:
            return user_error(
                CorruptCacheError,
                f"the row {name!r} of sample {key!r} in the dataset {problem}.",
                fix=_DOWNLOAD_AGAIN_FIX,
            )

        if value is None:
            raise refuse("is missing (null)")
        try:
            array = np.asarray(value)
            if array.dtype == object:  # nested arrays: rectangular, or refused
                array = np.array(array.tolist())
        except (ValueError, TypeError) as error:
            raise refuse(f"is not a rectangular array of numbers ({error})") from None
        if array.ndim != len(spec.shape) - 1:
            raise refuse(
                f"has {array.ndim} dimension(s); the export record says {len(spec.shape) - 1}"
            )
        if array.dtype == target:
            return array
        exact = {"b": "b", "i": "biu", "u": "biu", "f": "biuf"}[target.kind]
        if array.dtype.kind not in exact:
            raise refuse(
                f"holds {array.dtype} values where the export record says {target} "
                "(graphsplit does not convert rows with a loss)"
            )
        with np.errstate(all="ignore"):
            cast = array.astype(target)
            same = np.array_equal(
                cast.astype(array.dtype), array, equal_nan=array.dtype.kind == "f"
            )
        if not same:
            raise refuse(f"holds values that {target} cannot hold exactly")
        return cast

    def _orders(self, key: str, text: Any) -> tuple[tuple[int, ...] | None, ...]:
        try:
            orders = json.loads(text) if isinstance(text, (str, bytes)) else None
        except (ValueError, RecursionError):
            orders = None
        specs = list(self.specs.values())
        if (
            not isinstance(orders, list)
            or len(orders) != len(specs)
            or not all(
                order is None or valid_order(order, len(spec.shape))
                for order, spec in zip(orders, specs)
            )
        ):
            orders = None
        if orders is None:
            raise user_error(
                CorruptCacheError,
                f"the column {ORDERS_COLUMN!r} of sample {key!r} in the dataset is not a list "
                f"of {len(specs)} memory orders (null or a permutation of the row's "
                "dimensions).",
                fix=_DOWNLOAD_AGAIN_FIX,
            )
        return tuple(None if o is None else tuple(o) for o in orders)


@dataclass(frozen=True)
class _HeaderOnly:
    """What :func:`~graphsplit.caching.read.dataset.refuse_other_split` reads of a manifest:
    its header."""

    header: CacheHeader


class HFCachedDataset(torch.utils.data.Dataset):
    """A ``datasets.Dataset`` exported by ``to_hf_dataset``, read as a cache.

    Item ``i`` is the same :class:`~graphsplit.caching.read.collation.CachedSample` the cache folder
    gives (same key, rows, dtypes and memory orders), so ``DataLoader(..., collate_fn=
    graphsplit.collate)`` feeds ``split.stage2`` exactly as from the folder. With ``split``,
    a dataset this split did not make is refused (``StaleCacheError``), as ``CachedDataset``
    refuses a folder. A damaged row is a ``CorruptCacheError`` naming its key.
    """

    def __init__(self, dataset: Any, split: Split | None = None) -> None:
        self._rows = _Rows(dataset, split)
        self.dataset = dataset.with_format("numpy")
        self.keys: list[str] = [
            key.item() if isinstance(key, np.generic) else key for key in dataset[KEY_COLUMN]
        ]
        odd = next((key for key in self.keys if not isinstance(key, str)), "")
        if not isinstance(odd, str):
            raise user_error(
                CorruptCacheError,
                f"the dataset's {KEY_COLUMN!r} column holds {odd!r}, not a string.",
                fix=_DOWNLOAD_AGAIN_FIX,
            )

    @property
    def header(self) -> CacheHeader:
        """The cache's header; ``header.fingerprint`` is the cache's fingerprint."""
        return self._rows.record.header

    @property
    def constants(self) -> Mapping[str, torch.Tensor]:
        return self._rows.record.constants

    @property
    def max_abs_error(self) -> Mapping[str, float]:
        return self._rows.record.max_abs_error

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> CachedSample:
        return self._rows.item(self.dataset[int(index)])


class HFCachedIterable(torch.utils.data.IterableDataset):
    """A streamed ``datasets.IterableDataset`` exported by ``to_hf_dataset``, read as a
    cache: it yields the same items as :class:`HFCachedDataset`, in order."""

    def __init__(self, dataset: Any, split: Split | None = None) -> None:
        self._rows = _Rows(dataset, split)
        self.dataset = dataset

    @property
    def header(self) -> CacheHeader:
        return self._rows.record.header

    def __iter__(self) -> Iterator[CachedSample]:
        for row in self.dataset:
            yield self._rows.item(row)
