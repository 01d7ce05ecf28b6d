"""The export record: the JSON a Hugging Face dataset carries to be a graphsplit cache again.

It is the ``id`` of the ``key`` column's feature (see :mod:`graphsplit.caching.read.hf_export`
for why there). A dataset from the Hub is untrusted input: the record is read as strictly as
``manifest.json`` (strict JSON, every field typed, no JSON bomb), the constants are safetensors
bytes (never a pickle) whose names, dtypes and memory orders must agree with the header, and
every problem is a :class:`~graphsplit.errors.ManifestError` naming the field and the fix,
never a raw ``ValueError`` / ``JSONDecodeError`` / ``RuntimeError``.

Glossary:
    stored dtype: what the cache holds a tensor in. Arrow has no bfloat16, so a bfloat16 row
        is exported as float32 (an exact widening) and narrowed back on import; every other
        dtype is exported as it is (:func:`arrow_dtype`).

In and out::

    ExportRecord(header, max_abs_error, constants).to_json(constant_orders) -> str
    export_record(dataset) -> ExportRecord     # ManifestError naming what is wrong
    arrow_dtype(dtype) -> str | None           # the Arrow type a stored dtype is exported as
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from graphsplit.caching.format.layout import CacheHeader
from graphsplit.caching.format.memory_order import inverse
from graphsplit.caching.format.record_documents import header_rules
from graphsplit.caching.format.records import JsonReader, to_json
from graphsplit.caching.format.tensor_places import tensors_from_bytes
from graphsplit.errors import CacheError, Fix, ManifestError, user_error

__all__ = [
    "KEY_COLUMN",
    "ORDERS_COLUMN",
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "ExportRecord",
    "HFExportError",
    "arrow_dtype",
    "export_record",
    "valid_order",
]

RECORD_FORMAT = "graphsplit-hf-export"
RECORD_VERSION = 1
KEY_COLUMN = "key"
ORDERS_COLUMN = "_graphsplit_dim_orders"  # present only when some row has a memory order
_WIDENED = {torch.bfloat16: torch.float32}  # Arrow has no bfloat16: exact widening
_ARROW_DTYPES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
WHERE = "the dataset's features metadata (the 'key' feature's id)"
_EXPORT_AGAIN_FIX = Fix("export the cache again with graphsplit export (or to_hf_dataset)")


class HFExportError(CacheError):
    """A cache cannot be exported to ``datasets``, or a dataset read back as a cache."""


def arrow_dtype(dtype: torch.dtype) -> str | None:
    """The Arrow type name a tensor stored as ``dtype`` is exported as (None: none holds it
    exactly)."""
    return _ARROW_DTYPES.get(exported_dtype(dtype))


def exported_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a row stored as ``dtype`` has in the dataset (bfloat16 widened)."""
    return _WIDENED.get(dtype, dtype)


@dataclass(frozen=True)
class ExportRecord:
    """What a dataset exported by ``to_hf_dataset`` carries to become a cache again."""

    header: CacheHeader
    max_abs_error: Mapping[str, float]
    constants: Mapping[str, torch.Tensor]  # logical order, the dtype stage 2 takes

    def to_json(self, constant_orders: Mapping[str, Any]) -> str:
        physical = {}
        for name, value in self.constants.items():
            order = constant_orders.get(name)
            physical[name] = (value if order is None else value.permute(order)).contiguous()
        blob = save_safetensors(physical) if physical else b""
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "format_version": RECORD_VERSION,
                "header": to_json(self.header),
                "max_abs_error": dict(self.max_abs_error),
                "constants": base64.b64encode(blob).decode("ascii"),
                "constant_orders": {
                    k: (None if v is None else list(v)) for k, v in constant_orders.items()
                },
            },
            sort_keys=True,
        )


def _refuse(problem: str) -> ManifestError:
    return user_error(
        ManifestError, f"the export record in {WHERE} {problem}.", fix=_EXPORT_AGAIN_FIX
    )


def valid_order(value: Any, ndim: int) -> bool:
    """Whether ``value`` is a memory order (a permutation of ``range(ndim)``) as JSON gives it."""
    return (
        isinstance(value, list)
        and all(type(axis) is int for axis in value)
        and sorted(value) == list(range(ndim))
    )


def record_text(dataset: Any) -> str | None:
    """The record's text a dataset carries (None: none)."""
    features = getattr(dataset, "features", None) or {}
    key = features.get(KEY_COLUMN) if hasattr(features, "get") else None
    text = getattr(key, "id", None)
    return text if isinstance(text, str) and text else None


def is_export_record(text: str | None) -> bool:
    """Whether ``text`` is a graphsplit export record's JSON (its stamp only: how an earlier
    export is recognised before it is replaced)."""
    if not text:
        return False
    try:
        document = JsonReader(Path("<record>")).parse(text.encode())
    except ManifestError:
        return False
    return document.get("format") == RECORD_FORMAT


def export_record(dataset: Any) -> ExportRecord:
    """The export record a dataset made by ``to_hf_dataset`` carries.

    Raises:
        ManifestError: the dataset has no record (it was not exported by graphsplit) or a
            malformed one, naming what is wrong.
    """
    text = record_text(dataset)
    if text is None:
        raise user_error(
            ManifestError,
            f"this dataset carries no graphsplit export record in {WHERE}, so it is not a cache "
            "exported by graphsplit.",
            fix=Fix(
                "export the cache with graphsplit.caching.read.hf_export.to_hf_dataset(path), and "
                "keep its features (select or map columns without dropping 'key')"
            ),
        )
    reader = JsonReader(Path("<datasets features metadata>"))
    document = reader.parse(text.encode("utf-8", "surrogatepass"))  # strict, bombs refused
    if document.get("format") != RECORD_FORMAT:
        raise user_error(
            ManifestError,
            f"the record in {WHERE} is not a graphsplit export record.",
            fix=Fix("export the cache again with to_hf_dataset"),
        )
    version = document.get("format_version")
    if type(version) is not int or version != RECORD_VERSION:
        raise user_error(
            ManifestError,
            f"the export record in {WHERE} has format_version {version!r}; "
            f"this graphsplit reads {RECORD_VERSION}.",
            fix=Fix("read it with the graphsplit version that exported it, or export again"),
        )
    header = reader.read(CacheHeader, document.get("header"), "header")
    header_rules(reader, header)  # names, batch and pad dims, as a manifest's
    errors = _errors(reader.mapping(document.get("max_abs_error", {}), "max_abs_error"))
    orders = reader.mapping(document.get("constant_orders", {}), "constant_orders")
    for spec in header.sample_specs:
        if arrow_dtype(header.stored_dtype(spec)) is None:
            raise _refuse(
                f"stores the row {spec.name!r} as {header.stored_dtype(spec)}, which no Arrow "
                "column holds exactly"
            )
    return ExportRecord(header, errors, _constants(header, document.get("constants"), orders))


def _errors(errors: Mapping[str, Any]) -> dict[str, float]:
    for name, value in errors.items():
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise _refuse(f"gives max_abs_error[{name!r}] = {value!r}, not a finite number >= 0")
    return {name: float(value) for name, value in errors.items()}


def _constants(
    header: CacheHeader, encoded: Any, orders: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The constants the record carries, checked against the header: each named constant
    present, in its dtype and rank, in a valid memory order."""
    if not isinstance(encoded, str):
        raise _refuse(f"has constants of type {type(encoded).__name__}, not a base64 string")
    try:
        blob = base64.b64decode(encoded, validate=True)
        # The one strict reader of the format, as for every shard (a tensor named twice,
        # holes, overlaps and loose header numbers are refused, not served).
        physical = tensors_from_bytes(blob, source="the record's constants") if blob else {}
    except Exception as error:  # binascii.Error, CorruptCacheError
        raise _refuse(
            f"holds constants that cannot be read ({type(error).__name__}: {error})"
        ) from None
    specs = {spec.name: spec for spec in header.constant_specs}
    extra = sorted(set(physical) - set(specs))
    if extra:
        raise _refuse(f"holds constants {extra} that its header does not list")
    constants = {}
    for name, spec in specs.items():
        if name not in physical:
            raise _refuse(f"lacks the constant {name!r}")
        value, order = physical[name], orders.get(name)
        if value.dtype != spec.dtype or value.dim() != len(spec.shape):
            raise _refuse(
                f"holds the constant {name!r} as {value.dtype} of rank {value.dim()}; its header "
                f"says {spec.dtype} of rank {len(spec.shape)}"
            )
        if order is not None:
            if not valid_order(order, value.dim()):
                raise _refuse(f"gives constant_orders[{name!r}] = {order!r}, not a memory order")
            value = value.permute(inverse(tuple(order)))
        constants[name] = value
    return constants
