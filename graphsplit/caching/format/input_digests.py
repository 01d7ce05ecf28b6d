"""The input digest: what a sample's stage-1 inputs were, so a changed one is found by rehashing.

Glossary:
    input digest: sha256 of one sample's stage-1 inputs exactly as the loader collated them;
        the manifest stores one per sample (``input_sha256``), so a changed image is detected
        by rehashing the dataset (:func:`graphsplit.verify_inputs`) or the loader on resume.
    row: sample ``index`` of a value ``default_collate`` batched ``size`` samples into (a
        tensor's slice along dim 0; a mapping's or a list's rows, field by field).
    value bytes: what the digest is fed per value: a tag (``T`` tensor, ``M`` mapping, ``L``
        list, ``V`` plain value, ``I`` PIL image, ``O`` other object, by type alone) then its
        content; a tensor as :func:`~graphsplit.caching.format.fingerprint.update_with_tensor`
        feeds it, an image its mode, size and pixels (a raw sample's frames, DiffSynth's data).

In and out::

    batch_input_digests(batch: Mapping, names, size) -> list[str]    # one per row
    item_input_digest(item: Mapping, names) -> str                   # one dataset item
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from graphsplit.caching.format.fingerprint import update_with_tensor
from graphsplit.planning.step.raw_samples import is_image

__all__ = ["batch_input_digests", "item_input_digest"]


def batch_input_digests(batch: Mapping[str, Any], names: Sequence[str], size: int) -> list[str]:
    """The input digest of each of the ``size`` samples of a collated batch.

    Equal to digesting each row on its own (:func:`item_input_digest`'s bytes), but a tensor
    batched along dim 0 is made contiguous once and its rows are hashed as slices of that one
    buffer: per sample this costs a few hash updates, not a dozen torch calls.
    """
    digests = [hashlib.sha256() for _ in range(size)]
    for name in names if size else ():
        label = f"{name}=".encode()
        value = batch[name]
        rows = _tensor_rows(value, size)
        for index, digest in enumerate(digests):
            digest.update(label)
            if rows is None:
                _update_with_value(digest, _row(value, index, size))
            else:
                header, data, step = rows
                digest.update(header)
                digest.update(data[index * step : (index + 1) * step])
                digest.update(b";")
    return [digest.hexdigest() for digest in digests]


def _tensor_rows(value: Any, size: int) -> tuple[bytes, memoryview, int] | None:
    """For a tensor batched along dim 0: the bytes :func:`_update_with_value` feeds before
    each row's data, the batch's bytes in row order, and the bytes per row; else None."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != size:
        return None
    row_shape = tuple(value.shape[1:])
    header = f"T{str(value.dtype).removeprefix('torch.')}{row_shape}|".encode()
    flat = value.detach().to("cpu").contiguous().reshape(-1)
    data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    return header, data, len(data) // size


def item_input_digest(item: Mapping[str, Any], names: Sequence[str]) -> str:
    """The input digest of one dataset item, equal to its row's in a default-collated batch."""
    from torch.utils.data import default_collate

    return _digest_values((name, _row(default_collate([item[name]]), 0, 1)) for name in names)


def _row(value: Any, index: int, size: int) -> Any:
    """Sample ``index`` of a value that ``default_collate`` batched ``size`` samples into."""
    if isinstance(value, torch.Tensor):
        return value[index] if value.dim() > 0 and value.shape[0] == size else value
    if isinstance(value, Mapping):
        return {key: _row(item, index, size) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(item, (torch.Tensor, Mapping)) for item in value):
            return [_row(item, index, size) for item in value]  # fields collated one by one
        if len(value) == size:
            return value[index]
    return value


def _digest_values(pairs: Iterable[tuple[str, Any]]) -> str:
    digest = hashlib.sha256()
    for name, value in pairs:
        digest.update(f"{name}=".encode())
        _update_with_value(digest, value)
    return digest.hexdigest()


def _update_with_value(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        digest.update(b"T")
        update_with_tensor(digest, value)
    elif isinstance(value, Mapping):
        digest.update(f"M{len(value)}".encode())
        for key in sorted(value, key=str):
            digest.update(f"{key}:".encode())
            _update_with_value(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _update_with_value(digest, item)
    elif isinstance(value, (str, int, float, bool, bytes)) or value is None:
        digest.update(f"V{value!r}".encode())
    elif is_image(value):
        digest.update(f"I{value.mode}{value.size}|".encode())
        digest.update(value.tobytes())
    else:  # an object without a stable byte form: only its type takes part
        digest.update(f"O{type(value).__qualname__}".encode())
    digest.update(b";")
