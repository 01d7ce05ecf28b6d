"""The cache's records as JSON documents: their bytes, and strict reading with the rules that
span fields. Pure: the bytes come from and go to the store
(:mod:`graphsplit.caching.store.record_files`).

Glossary:
    document: the JSON object of one record file (``manifest.json``, ``.partial/header.json``,
        a progress record), as :meth:`~graphsplit.caching.format.records.JsonReader.parse`
        gives it.
    stamp: ``format`` and ``format_version``, the first two fields of the manifest and the
        resume header (see :mod:`graphsplit.caching.format.layout`); a document of another
        format, or of a version this graphsplit cannot read, is refused by its stamp before
        anything else is read.
    upgrade: a format-1 file record's ``"sha256": hex`` read as ``"checksum": "sha256:hex"``,
        in place, before the strict reading (format 1 is graphsplit 0.1's).
    rules across fields: what the dataclasses' types cannot say (a shard's file name is its
        index's, each row lists one shape per per-sample tensor, no sample key twice...);
        checked after the types, each refusal a :class:`ManifestError` naming file and field.

In and out::

    manifest_bytes(manifest) -> bytes             resume_header_bytes(header) -> bytes
    progress_bytes(progress) -> bytes             progress_file_name(progress) -> str
    manifest_from(reader, document) -> Manifest
    resume_header_from(reader, document) -> CacheHeader
    header_rules(reader, header)      # the rules across a header's fields (ManifestError)
    shard_progress_from(reader, document, index, header) -> ShardProgress    # ManifestError
    constants_progress_from(reader, document, header) -> ConstantsProgress   # ManifestError
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from graphsplit.caching.format.layout import (
    CONSTANTS_FILE,
    CONSTANTS_PROGRESS_FILE,
    FORMAT,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    CacheHeader,
    ConstantsProgress,
    ConstantsRecord,
    Manifest,
    PlanRecord,
    ShardProgress,
    ShardRecord,
    plan_constants_file,
    shard_file_name,
)
from graphsplit.caching.format.memory_order import Order
from graphsplit.caching.format.records import (
    REBUILD,
    JsonReader,
    json_names,
    optional_names,
    to_json,
)
from graphsplit.errors import Fix, ManifestError, Remedy, user_error

_PLAN_KEY = re.compile(r"[0-9a-f]{16}")
_PLAN_KEY_MEANING = "a signature key (16 lowercase hex digits)"

__all__ = [
    "constants_progress_from",
    "header_rules",
    "manifest_bytes",
    "manifest_from",
    "progress_bytes",
    "progress_file_name",
    "resume_header_bytes",
    "resume_header_from",
    "shard_progress_from",
]


# ------------------------------------------------------------------------------------ writing


def manifest_bytes(manifest: Manifest) -> bytes:
    """``manifest.json``'s bytes: stamped, one shard per line, so diffs and greps stay
    readable."""
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, **to_json(manifest)}
    return (_format_json(document) + "\n").encode()


def resume_header_bytes(header: CacheHeader) -> bytes:
    """``.partial/header.json``'s bytes: the stamped header, indented."""
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, **to_json(header)}
    return json.dumps(document, indent=2).encode()


def progress_bytes(progress: ShardProgress | ConstantsProgress) -> bytes:
    """A progress record's bytes (one line; progress records carry no stamp)."""
    return json.dumps(to_json(progress)).encode()


def progress_file_name(progress: ShardProgress | ConstantsProgress) -> str:
    """Its name in ``.partial/``: ``shard-00007.json`` for shard 7, or ``constants.json``."""
    if isinstance(progress, ShardProgress):
        return Path(progress.shard.file).with_suffix(".json").name
    return CONSTANTS_PROGRESS_FILE


def _format_json(value: Any, depth: int = 0, *, inline: bool = False) -> str:
    """Indented JSON whose lists of scalars, and each shard record, stay on one line."""
    pad, end = "  " * (depth + 1), "  " * depth
    if inline or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value)
    if isinstance(value, dict):
        items = (
            f"{pad}{json.dumps(key)}: {_format_json(item, depth + 1, inline=False)}"
            if key != "shards"
            else f"{pad}{json.dumps(key)}: "
            + "[\n"
            + ",\n".join(f"{pad}  {json.dumps(shard)}" for shard in item)
            + f"\n{pad}]"
            for key, item in value.items()
        )
        return "{\n" + ",\n".join(items) + f"\n{end}}}"
    if not any(isinstance(item, (dict, list)) for item in value):
        return json.dumps(value)
    return "[\n" + ",\n".join(pad + _format_json(item, depth + 1) for item in value) + f"\n{end}]"


# ------------------------------------------------------------------------------------ reading


def manifest_from(reader: JsonReader, document: dict[str, Any]) -> Manifest:
    """``manifest.json``'s document as a :class:`Manifest`, strictly.

    Raises:
        ManifestError: malformed, of another format version, or naming files outside the
            folder; the message names the field.
    """
    manifest: Manifest = _read_stamped(reader, document, Manifest)
    header = manifest.header
    header_rules(reader, header)
    if manifest.constants is None and header.constant_specs:
        reader.fail("constants", "is null but the boundary has per-dataset constants")
    if manifest.constants is not None:
        _constants_rules(reader, manifest.constants, header, "constants")
    _plan_constants_rules(reader, manifest.plans, header, "plans")
    for index, shard in enumerate(manifest.shards):
        _shard_rules(reader, shard, header, index, f"shards[{index}]")
    _error_rules(reader, manifest.max_abs_error, header, "max_abs_error")
    counted = sum(len(shard.keys) for shard in manifest.shards)
    if manifest.num_samples != counted:
        reader.fail("num_samples", f"is {manifest.num_samples} but the shards list {counted}")
    _unique_keys_rule(reader, manifest.shards)
    return manifest


def resume_header_from(reader: JsonReader, document: dict[str, Any]) -> CacheHeader:
    """A resume header's document as a :class:`CacheHeader`, strictly (ManifestError)."""
    header: CacheHeader = _read_stamped(reader, document, CacheHeader)
    header_rules(reader, header)
    return header


def shard_progress_from(
    reader: JsonReader, document: dict[str, Any], index: int, header: CacheHeader
) -> ShardProgress:
    """Shard ``index``'s progress record, strictly, against the run's ``header``."""
    _upgrade_file_record(document)
    progress: ShardProgress = reader.read(ShardProgress, document)
    _shard_rules(reader, progress.shard, header, index, "")
    _error_rules(reader, progress.max_abs_error, header, "max_abs_error")
    _plan_constants_rules(reader, progress.plans, header, "plans")
    return progress


def constants_progress_from(
    reader: JsonReader, document: dict[str, Any], header: CacheHeader
) -> ConstantsProgress:
    """The constants file's progress record, strictly, against the run's ``header``."""
    _upgrade_file_record(document)  # the constants record is inline
    progress: ConstantsProgress = reader.read(ConstantsProgress, document)
    _constants_rules(reader, progress.constants, header, "constants")
    _error_rules(reader, progress.max_abs_error, header, "max_abs_error")
    return progress


def _read_stamped(reader: JsonReader, document: dict[str, Any], cls: type) -> Any:
    """A document that opens with the stamp: check the stamp first, then read the rest."""
    stamp = ("format", "format_version")
    reader.require_names(document, "", (*stamp, *json_names(cls)), optional=optional_names(cls))
    if document["format"] != FORMAT:
        reader.fail("format", f"is {document['format']!r}; expected {FORMAT!r}")
    version = document["format_version"]
    if type(version) is not int:
        reader.fail("format_version", f"is {version!r}; expected an integer")
    if version not in READABLE_VERSIONS:
        upgrade = "upgrade graphsplit to read it, or " if version > FORMAT_VERSION else ""
        raise user_error(
            ManifestError,
            f"{reader.path} has cache format version {version}, this graphsplit reads versions "
            f"{READABLE_VERSIONS[0]} to {FORMAT_VERSION}.",
            fix=Fix(upgrade + REBUILD, Remedy.OVERWRITE),
        )
    if version == 1:
        _upgrade_file_record(document.get("constants"))
        shards = document.get("shards")
        for shard in shards if isinstance(shards, list) else ():
            _upgrade_file_record(shard)
    return reader.read(cls, {key: value for key, value in document.items() if key not in stamp})


def _upgrade_file_record(record: Any) -> None:
    """Turn a format-1 file record's ``"sha256": hex`` into ``"checksum": "sha256:hex"``, in
    place (anything else is left for the strict reader to judge)."""
    if isinstance(record, dict) and "sha256" in record and "checksum" not in record:
        value = record.pop("sha256")
        record["checksum"] = f"sha256:{value}" if isinstance(value, str) else value


# ---------------------------------------------------- rules that span fields (after the types)


def header_rules(reader: JsonReader, header: CacheHeader) -> None:
    """The rules across a header's fields (a manifest's, a resume header's, an export
    record's): identifier names, and batch and pad dims that are dims of their shapes."""
    for index, spec in enumerate(header.boundary):
        where = f"boundary[{index}]"
        if not spec.name.isidentifier():
            reader.fail(f"{where}.name", f"is {spec.name!r}; expected a Python identifier")
        if spec.batch_dim is not None and spec.batch_dim >= len(spec.shape):
            reader.fail(
                f"{where}.batch_dim",
                f"is {spec.batch_dim!r}; expected null or a dim of {spec.shape}",
            )
        pad = spec.pad_dim
        if pad is not None and (spec.batch_dim in (None, pad) or pad >= len(spec.shape)):
            reader.fail(
                f"{where}.pad_dim",
                f"is {pad!r}; expected null, or a dim of {spec.shape} other than the batch dim "
                "of a per-sample tensor",
            )
    names = [spec.name for spec in header.boundary]
    if len(set(names)) != len(names):
        reader.fail("boundary", f"repeats a name: {names}")
    paired = header.paired_rows
    if paired is not None and not all(
        0 <= row < paired.rows for group in paired.groups for row in group
    ):
        reader.fail("paired_rows.groups", f"names a row outside the example's {paired.rows}")


def _plan_constants_rules(
    reader: JsonReader, plans: Mapping[str, PlanRecord] | None, header: CacheHeader, where: str
) -> None:
    """A plan's own constants: the file named by its key, the header's constant names."""
    for key, plan in (plans or {}).items():
        if plan.constants is None:
            continue
        if not _PLAN_KEY.fullmatch(key):
            reader.fail(f"{where}", f"names the plan {key!r}; expected {_PLAN_KEY_MEANING}")
        place = f"{where}.{key}.constants"
        _constants_rules(reader, plan.constants, header, place, plan_constants_file(key))


def _constants_rules(
    reader: JsonReader,
    record: ConstantsRecord,
    header: CacheHeader,
    where: str,
    file: str = CONSTANTS_FILE,
) -> None:
    if record.file != file:
        reader.fail(f"{where}.file", f"is {record.file!r}; expected {file!r}")
    specs = {spec.name: spec for spec in header.constant_specs}
    if set(record.dim_orders) != set(specs):
        reader.fail(
            f"{where}.dim_orders", f"names {sorted(record.dim_orders)}, not {sorted(specs)}"
        )
    for name, order in record.dim_orders.items():
        _order_rule(reader, order, f"{where}.dim_orders.{name}", len(specs[name].shape))


def _shard_rules(
    reader: JsonReader, record: ShardRecord, header: CacheHeader, index: int, where: str
) -> None:
    if record.file != shard_file_name(index):
        reader.fail(
            _join(where, "file"),
            f"is {record.file!r}; shard {index} must be {shard_file_name(index)!r} "
            "(a file name inside the cache folder)",
        )
    specs = header.sample_specs
    for row, (shapes, orders) in enumerate(zip(record.shapes, record.row_orders)):
        shapes_at, orders_at = _join(where, f"shapes[{row}]"), _join(where, f"dim_orders[{row}]")
        tensors = f"{len(specs)} per-sample tensors"
        if len(shapes) != len(specs):
            reader.fail(shapes_at, f"lists {len(shapes)} shapes for {tensors}")
        if len(orders) != len(specs):
            reader.fail(orders_at, f"lists {len(orders)} orders for {tensors}")
        for column, (shape, order, spec) in enumerate(zip(shapes, orders, specs)):
            if len(shape) != len(spec.shape) - 1:
                reader.fail(
                    f"{shapes_at}[{column}]",
                    f"has {len(shape)} dims; a row of {spec.name!r} has {len(spec.shape) - 1}",
                )
            _order_rule(reader, order, f"{orders_at}[{column}]", len(spec.shape))
    counts = {len(record.keys), len(record.shapes), len(record.row_orders)}
    if len(counts | {len(record.input_sha256)}) > 1:
        reader.fail(
            where or "shard record", "lists different numbers of keys, shapes, orders and digests"
        )
    _batch_rows_rule(reader, record, header, where)


def _batch_rows_rule(
    reader: JsonReader, record: ShardRecord, header: CacheHeader, where: str
) -> None:
    """A paired cache's shard lists its stage-1 batches' row counts, adding up to its rows;
    an ordinary cache's lists none."""
    counts = record.batch_rows
    if counts is None and header.paired_rows is not None:
        reader.fail(
            where or "shard record",
            "lacks batch_rows, which a cache whose stage 2 pairs rows by position needs",
        )
    if counts is not None and header.paired_rows is None:
        reader.fail(_join(where, "batch_rows"), "is given in a cache without paired_rows")
    if counts is not None and sum(counts) != len(record.keys):
        reader.fail(
            _join(where, "batch_rows"),
            f"adds up to {sum(counts)} rows but the shard holds {len(record.keys)}",
        )


def _order_rule(reader: JsonReader, order: Order | None, where: str, ndim: int) -> None:
    if order is not None and sorted(order) != list(range(ndim)):
        reader.fail(where, f"is {list(order)}, not an order of {ndim} dims")


def _error_rules(
    reader: JsonReader, errors: Mapping[str, float], header: CacheHeader, where: str
) -> None:
    names = {spec.name for spec in header.boundary}
    for name in errors:
        if name not in names:
            reader.fail(where, f"names {name!r}, which is not a boundary tensor")


def _unique_keys_rule(reader: JsonReader, shards: Iterable[ShardRecord]) -> None:
    seen: dict[str, int] = {}
    for index, shard in enumerate(shards):
        for key in shard.keys:
            if key in seen:
                reader.fail(
                    "shards", f"list the sample key {key!r} twice (shards {seen[key]}, {index})"
                )
            seen[key] = index


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
