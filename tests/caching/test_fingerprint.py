"""Fingerprints: what changes them, and what they need."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zlib

import numpy
import pytest
import torch
import xxhash

from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.format import checksums
from graphsplit.caching.format.fingerprint import (
    WEIGHT_HASHES,
    _digest_tensors,
    differences,
    fingerprint,
)
from graphsplit.caching.format.input_digests import batch_input_digests, item_input_digest
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CacheError, StaleCacheError
from tests.caching.fixtures import (
    ROOT,
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


def test_the_weights_digest_is_an_xxh3_128_per_tensor_mixed_by_sha256():
    values = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    data = values.numpy().tobytes()
    expected = hashlib.sha256(b"w|float32(300000,)|" + xxhash.xxh3_128(data).digest())
    assert _weights({"w": values}, "xxh3") == "xxh3:" + expected.hexdigest()
    transposed = values.reshape(600, 500).t()  # not contiguous: hashed in logical order
    logical = transposed.contiguous().numpy().tobytes()
    expected = hashlib.sha256(b"w|float32(500, 600)|" + xxhash.xxh3_128(logical).digest())
    assert _weights({"w": transposed}, "xxh3") == "xxh3:" + expected.hexdigest()


def test_the_crc32_weights_digest_is_a_crc32_per_mib_mixed_by_sha256():
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


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32"])
@pytest.mark.parametrize("byte", [0, (1 << 20) - 1, 1 << 20, 1_199_999])  # MiB edges, the end
def test_one_flipped_bit_anywhere_changes_the_weights_digest(byte, algorithm):
    values = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    before = _weights({"w": values}, algorithm)
    values.view(torch.uint8)[byte] ^= 1  # in place, through a view: the memo must see it
    assert _weights({"w": values}, algorithm) != before


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32", "sha256"])
def test_names_dtypes_and_shapes_take_part_in_the_weights_digest(algorithm):
    values = torch.arange(12, dtype=torch.float32)
    digest = _weights({"w": values}, algorithm)
    assert _weights({"v": values}, algorithm) != digest
    assert _weights({"w": values.view(torch.int32)}, algorithm) != digest  # the same bytes
    assert _weights({"w": values.reshape(3, 4)}, algorithm) != digest
    assert _weights({"w": values.to(torch.bfloat16)}, algorithm) != digest
    assert _weights({"w": values.clone()}, algorithm) == digest
    assert _weights({"w": values[6:]}, algorithm) != _weights({"w": values[:6]}, algorithm)


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])  # earlier 0.2 caches, graphsplit 0.1
def test_a_cache_with_older_weights_digests_still_matches(path, split, algorithm):
    old = fingerprint(split, weights_algorithm=algorithm).weights
    assert old.startswith(f"{algorithm}:") and fingerprint(split).weights.startswith("xxh3:")
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


def test_an_xxh3_cache_without_xxhash_asks_for_the_package(path, split, monkeypatch):
    monkeypatch.setattr(checksums, "xxhash", None)  # the one import of xxhash
    with pytest.raises(
        CacheError, match=r"(?s)weights fingerprint is an XXH3 digest.*fix:    pip install xxhash"
    ):
        CachedDataset(path, split)


# ------------------------------------------------------------------ remembered weight hashes


def _hashed(function):
    """How many bytes of weights ``function()`` read to hash, and what it returned."""
    before = WEIGHT_HASHES.hashed_bytes
    result = function()
    return WEIGHT_HASHES.hashed_bytes - before, result


def test_weights_are_hashed_once_per_process_until_changed_in_place():
    split = make_split(Model(seed=3))
    weight = split.model.encoder.conv.weight
    size = weight.numel() * weight.element_size()
    first = _hashed(lambda: fingerprint(split).weights)
    assert first[0] > size
    assert _hashed(lambda: fingerprint(split).weights) == (0, first[1])  # remembered
    with torch.no_grad():
        weight[0, 0, 0, 0] += 1.0  # a view's in-place update bumps the shared version counter
    changed = _hashed(lambda: fingerprint(split).weights)
    assert changed[0] == size and changed[1] != first[1]  # only that tensor is read again
    split.model.encoder.load_state_dict(Model(seed=3).encoder.state_dict())
    assert _hashed(lambda: fingerprint(split).weights)[1] == first[1]
    WEIGHT_HASHES.forget()
    assert _hashed(lambda: fingerprint(split).weights) == first


def test_replaced_or_freed_storages_are_never_taken_for_the_remembered_ones():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    digest = _weights({"w": values}, "xxh3")
    values.data = values.data + 1.0  # a new storage under the same tensor object
    assert _weights({"w": values}, "xxh3") != digest
    for _ in range(5):  # a freed storage's address is often reused at once
        before = torch.zeros(1000)
        remembered = _weights({"w": before}, "xxh3")
        address = before.untyped_storage().data_ptr()
        del before
        after = torch.ones(1000)
        assert _weights({"w": after}, "xxh3") != remembered, address
    with torch.inference_mode():  # no version counter: hashed every time
        frozen = torch.zeros(1000)
    digest = _weights({"w": frozen}, "xxh3")
    with torch.inference_mode():
        frozen.add_(1.0)
    assert _weights({"w": frozen}, "xxh3") != digest


def test_the_weights_fingerprint_is_the_same_in_another_process():
    split = make_split(Model(seed=5))
    here = fingerprint(split).weights
    script = (
        "from graphsplit.caching.format.fingerprint import fingerprint\n"
        "from tests.caching.fixtures import Model, make_split\n"
        "print(fingerprint(make_split(Model(seed=5))).weights)\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "123"}
    there = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True,
        env=environment, cwd=ROOT,
    ).stdout.strip()  # fmt: skip
    assert here == there and here.startswith("xxh3:")


# ------------------------------------------------------------------ input digests


def _row_by_row(batch, names, size):
    """The digests as graphsplit <= 0.2 computed them: each row cut out and hashed alone."""
    from graphsplit.caching.format.input_digests import _digest_values, _row

    return [
        _digest_values((name, _row(batch[name], index, size)) for name in names)
        for index in range(size)
    ]


def test_batch_input_digests_equal_those_of_each_row_alone():
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(3, 3, 4, 5, generator=generator)
    batch = {
        "pixels": pixels,
        "channels_last": pixels.to(memory_format=torch.channels_last),
        "half": pixels.to(torch.bfloat16),
        "ids": torch.arange(3),  # rows are 0-dim
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(3, 0),
        "shared": torch.ones(2, 2),  # not batched: the same in every row
        "nested": {"a": pixels[:, 0], "captions": ["x", "y", "z"]},
        "captions": ["a cat", "a dog", "a cow"],
        "size": 7,
    }
    names = list(batch)
    digests = batch_input_digests(batch, names, 3)
    assert digests == _row_by_row(batch, names, 3)
    assert len(set(digests)) == 3
    collated = [name for name in names if name not in ("shared", "size")]  # default_collate's
    item = {name: _item(batch[name], 1) for name in collated}
    assert batch_input_digests(batch, collated, 3)[1] == item_input_digest(item, collated)
    assert batch_input_digests({}, [], 0) == []


def _item(value, index):
    """Item ``index`` of a default-collated batch value, as a dataset would return it."""
    if isinstance(value, torch.Tensor):
        return value[index] if value.dim() and value.shape[0] == 3 else value
    if isinstance(value, dict):
        return {key: _item(item, index) for key, item in value.items()}
    if isinstance(value, list):
        return value[index]
    return value


def test_a_raw_samples_images_are_digested_by_their_pixels():
    """DiffSynth's loader hands a sample's PIL frames as they are: two samples with the same
    prompt and other frames must not share an input digest (a changed frame must be found)."""
    image = pytest.importorskip("PIL.Image")
    pixels = numpy.random.default_rng(0).integers(0, 256, (4, 4, 3), dtype=numpy.uint8)
    changed = pixels.copy()
    changed[0, 0, 0] ^= 1

    def sample(array, mode="RGB"):
        return {"video": [image.fromarray(array).convert(mode)], "prompt": "a cat"}

    names = ["video", "prompt"]
    digest = batch_input_digests(sample(pixels), names, 1)[0]
    assert batch_input_digests(sample(pixels.copy()), names, 1)[0] == digest
    assert batch_input_digests(sample(changed), names, 1)[0] != digest
    assert batch_input_digests(sample(pixels, "RGBA"), names, 1)[0] != digest
