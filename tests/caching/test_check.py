"""check_cache: damaged, missing and foreign files, reported with their samples."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store.regular_files import checksum_file
from graphsplit.errors import CorruptCacheError
from tests.caching.fixtures import flip_last_byte, rewrite_manifest


def test_corrupt_shard_is_reported_and_other_shards_read(path):
    flip_last_byte(path / "shard-00002.safetensors")
    report = check_cache(path)
    assert not report.ok
    assert report.damaged_keys == ["pic004", "pic005"]
    assert "shard-00002.safetensors: its xxh3 checksum differs" in str(report)
    cached = CachedDataset(path)
    with pytest.raises(
        CorruptCacheError, match=r"(?s)shard-00002.safetensors.*'pic004', 'pic005'.*check_cache"
    ):
        cached[4]
    with pytest.raises(CorruptCacheError, match="shard-00002"):
        cached[5]  # remembered, not rehashed
    assert cached[3]["key"] == "pic003" and cached[6]["key"] == "pic006"


def test_missing_and_truncated_shards_are_reported(path):
    (path / "shard-00000.safetensors").unlink()
    truncated = path / "shard-00003.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    report = check_cache(path)
    text = str(report)
    assert "shard-00000.safetensors: the file is missing" in text
    assert "shard-00003.safetensors: it has 100 bytes, the manifest records" in text
    assert "4 of 12 samples unreadable" in text and "overwrite=True" in text
    with pytest.raises(CorruptCacheError, match="the file is missing"):
        CachedDataset(path)[0]


def test_corrupt_constants_are_refused(path):
    flip_last_byte(path / "constants.safetensors")
    assert "constants.safetensors" in str(check_cache(path))
    with pytest.raises(CorruptCacheError, match=r"constants.safetensors .* is damaged"):
        CachedDataset(path)


def test_shard_with_other_tensors_than_listed_is_reported(path):
    shard = path / "shard-00000.safetensors"
    save_file({"0/latents": torch.zeros(4, 4, 4)}, shard)
    rewrite_manifest(
        path,
        lambda d: d["shards"][0].update(checksum=checksum_file(shard), bytes=shard.stat().st_size),
    )
    assert "its tensors differ from the manifest's" in str(check_cache(path))
    with pytest.raises(CorruptCacheError, match="tensors differ"):
        CachedDataset(path)[0]


def test_check_cache_of_a_good_cache(path):
    report = check_cache(path)
    assert report.ok and report.num_samples == 12 and report.num_shards == 6
    assert str(report).endswith("bytes verified)") and "OK" in str(report)


def test_check_cache_reports_a_bad_manifest(tmp_path):
    report = check_cache(tmp_path)
    assert not report.ok and "manifest.json is missing" in str(report)
