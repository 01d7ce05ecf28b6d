"""Fingerprints: what changes them, and what they need."""

from __future__ import annotations

import hashlib
import zlib

import pytest
import torch

from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.dataset import CachedDataset
from graphsplit.caching.fingerprint import _digest_tensors, differences, fingerprint
from graphsplit.caching.run import cache
from graphsplit.errors import CacheError, StaleCacheError
from tests.caching.fixtures import (
    SMALL,
    Model,
    Pictures,
    loader,
    make_split,
    rewrite_manifest,
    trace,
)


def test_trace_time_sizes_do_not_change_the_fingerprint():
    split = make_split()
    other = make_split()
    spec = other.boundary["latents"]
    other.boundary["latents"] = BoundarySpec("latents", (7, 4, 9, 9), spec.dtype, 0, 1, "y:9")
    assert differences(fingerprint(split), fingerprint(other)) == ()


def test_fingerprint_needs_real_weights():
    split = make_split()
    split.stage1 = trace(Model().encoder.to("meta"))
    with pytest.raises(CacheError, match="on the meta device"):
        fingerprint(split)


# ------------------------------------------------------------------ the weights digest


def _weights(tensors: dict[str, torch.Tensor], algorithm: str = "crc32") -> str:
    return _digest_tensors(sorted(tensors.items()), algorithm)


def test_the_weights_digest_is_a_crc32_per_mib_mixed_by_sha256():
    values = torch.randn(300_000, generator=torch.Generator().manual_seed(0))  # 1.14 MiB
    data = values.numpy().tobytes()
    crcs = b"".join(
        zlib.crc32(data[start : start + (1 << 20)]).to_bytes(4, "little")
        for start in range(0, len(data), 1 << 20)
    )
    expected = hashlib.sha256(b"w|float32(300000,)|" + crcs).hexdigest()
    assert _weights({"w": values}) == "crc32:" + expected
    old = hashlib.sha256(b"w|float32(300000,)|" + data).hexdigest()  # graphsplit 0.1
    assert _weights({"w": values}, "sha256") == "sha256:" + old


@pytest.mark.parametrize("byte", [0, (1 << 20) - 1, 1 << 20, 1_199_999])  # MiB edges, the end
def test_one_flipped_bit_anywhere_changes_the_weights_digest(byte):
    values = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    before = _weights({"w": values})
    values.view(torch.uint8)[byte] ^= 1
    assert _weights({"w": values}) != before


def test_names_dtypes_and_shapes_take_part_in_the_weights_digest():
    values = torch.arange(12, dtype=torch.float32)
    digest = _weights({"w": values})
    assert _weights({"v": values}) != digest
    assert _weights({"w": values.view(torch.int32)}) != digest  # the same bytes
    assert _weights({"w": values.reshape(3, 4)}) != digest
    assert _weights({"w": values.to(torch.bfloat16)}) != digest
    assert _weights({"w": values.clone()}) == digest


def test_a_cache_with_sha256_weights_of_graphsplit_0_2_still_matches(path, split):
    old = fingerprint(split, weights_algorithm="sha256").weights
    assert old.startswith("sha256:") and fingerprint(split).weights.startswith("crc32:")
    rewrite_manifest(path, lambda d: d["fingerprint"].update(weights=old))
    before = (path / "manifest.json").read_bytes()
    CachedDataset(path, split)  # compared in the cache's own terms: no StaleCacheError
    info = cache(split, loader(Pictures(12)), path, shard_bytes=SMALL, progress=False)
    assert (info.written_shards, info.reused_shards) == (0, 6)
    assert (path / "manifest.json").read_bytes() == before
    with torch.no_grad():
        split.model.encoder.conv.weight[0, 0, 0, 0] += 1.0
    with pytest.raises(StaleCacheError, match="frozen weights differ"):
        CachedDataset(path, split)
    with pytest.raises(StaleCacheError, match="frozen weights differ"):
        cache(split, loader(Pictures(12)), path, shard_bytes=SMALL, progress=False)
