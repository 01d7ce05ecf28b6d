"""The bytes checked are the bytes read: locally, on the S3 server, and through read-through copies.

Each attack swaps a file at the worst moment: a local shard renamed over between its checksum
and its reads; an S3 object replaced after the cache was written, or while a reader holds it
open; a remote cache rebuilt under a ``local_cache`` that holds copies of its old files. Each
ends with the checked bytes or a graphsplit error naming the file and the fix.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from graphsplit.caching.format.checksums import Running
from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store import mapped
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CorruptCacheError
from tests.caching.fixtures import SMALL, Model, Pictures, loader, make_split

SHARD = "shard-00001.safetensors"  # samples 2 and 3


def _tampered(data: bytes) -> bytes:
    """The same file with its last tensor byte changed: same size, same header."""
    changed = bytearray(data)
    changed[-1] ^= 0x40
    return bytes(changed)


def test_a_local_shard_renamed_over_after_its_checksum_is_not_what_is_read(path, monkeypatch):
    """The checksum and the reads come from one open: the file swapped in right after the
    checksum was computed is never served."""
    expected = CachedDataset(path, verify=False)[2]["latents"].clone()
    shard = path / SHARD
    original = shard.read_bytes()

    class SwapAfterChecksum(Running):
        def checksum(self) -> str:
            result = super().checksum()
            swap = path / "swap.tmp"
            swap.write_bytes(_tampered(original))
            os.replace(swap, shard)  # an attacker renames another file over the checked one
            return result

    cached = CachedDataset(path)
    monkeypatch.setattr(mapped, "Running", SwapAfterChecksum)
    item = cached[2]  # opens shard 1: checksum, swap, then the reads
    monkeypatch.setattr(mapped, "Running", Running)
    assert torch.equal(item["latents"], expected)
    assert shard.read_bytes() == _tampered(original)  # the swap happened; its bytes were not read
    # The next open of that file (a new dataset) checks the bytes now there, and refuses them.
    with pytest.raises(CorruptCacheError, match=rf"(?s){SHARD}.*checksum differs.*fix:"):
        CachedDataset(path)[2]


@pytest.fixture
def remote(s3, bucket):
    url = f"s3://{bucket}/cache"
    cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    return url, f"{bucket}/cache"


def test_the_manifest_records_each_objects_version(s3, remote):
    _, prefix = remote
    manifest = json.loads(s3.cat_file(f"{prefix}/manifest.json"))
    for record in [manifest["constants"], *manifest["shards"]]:
        assert record["etag"] == s3.info(f"{prefix}/{record['file']}")["ETag"]


def test_an_s3_object_replaced_after_the_cache_was_written_is_refused(s3, remote):
    """Same size, same header, other tensor bytes: without version pinning a verify=False
    reader (header only) served them and check_cache could only find them by checksum."""
    url, prefix = remote
    expected = CachedDataset(url)[3]["text"].clone()
    s3.pipe_file(f"{prefix}/{SHARD}", _tampered(s3.cat_file(f"{prefix}/{SHARD}")))
    for verify in (True, False):
        with pytest.raises(
            CorruptCacheError,
            match=rf"(?s){SHARD} of the cache at {url} is damaged: .*changed after the cache "
            r"was written.*manifest records.*fix:.*rebuild the cache",
        ):
            CachedDataset(url, verify=verify)[3]
    report = check_cache(url)
    assert [problem.file for problem in report.problems] == [SHARD]
    assert "changed after the cache was written" in str(report)
    # The other shards still read, the bytes they were written with.
    assert torch.equal(CachedDataset(url, verify=False)[0]["text"], CachedDataset(url)[0]["text"])
    assert not torch.equal(expected, torch.zeros_like(expected))


def test_an_s3_object_replaced_while_a_reader_holds_it_is_refused_mid_read(s3, remote):
    url, prefix = remote
    cached = CachedDataset(url, verify=False)
    first = cached[2]  # opens the shard: its version is pinned from here on
    s3.pipe_file(f"{prefix}/{SHARD}", _tampered(s3.cat_file(f"{prefix}/{SHARD}")))
    with pytest.raises(
        CorruptCacheError,
        match=rf"(?s){SHARD} changed while it was being read \(the store now holds another "
        r"version\).*fix:    run graphsplit.check_cache on the cache, then rebuild",
    ):
        cached[3]  # the same open shard: the store refuses the old version's If-Match
    assert first["key"] == "pic002"


def test_a_forked_worker_reopens_a_pinned_object_and_checks_its_version(s3, remote):
    url, _ = remote
    cached = CachedDataset(url)
    parent = cached[0]  # shard 0 is open in the parent: workers inherit it, then reopen it
    context = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None
    batches = torch.utils.data.DataLoader(
        cached, batch_size=2, num_workers=2, collate_fn=collate, multiprocessing_context=context
    )
    together = torch.cat([batch["latents"] for batch in batches])
    assert torch.equal(together[0], parent["latents"])
    assert together.shape[0] == 12


def test_a_rebuilt_remote_cache_never_serves_an_old_local_copy(s3, remote, tmp_path):
    """Copies are keyed by content checksum: the rebuilt cache's files (same names, same
    sizes, other bytes) are downloaded anew, even with verify=False (copies trusted by size)."""
    url, _ = remote
    scratch = tmp_path / "scratch"
    first = CachedDataset(url, local_cache=scratch)
    old = [item["latents"].clone() for item in first]
    old_table = first.constants["table"].clone()
    other = make_split(Model(seed=1), scale=3.0)  # other weights: other rows and constants
    cache(other, loader(Pictures(12)), url, shard_bytes=SMALL, progress=False, overwrite=True)
    rebuilt = CachedDataset(url, other, verify=False, local_cache=scratch)
    direct = CachedDataset(url, other)
    assert torch.equal(rebuilt.constants["table"], direct.constants["table"])
    assert not torch.equal(rebuilt.constants["table"], old_table)
    for index in range(12):
        assert torch.equal(rebuilt[index]["latents"], direct[index]["latents"])
        assert not torch.equal(rebuilt[index]["latents"], old[index])
    names = {entry.name for entry in (scratch / "by-checksum").iterdir()}
    records = [direct.manifest.constants, *direct.manifest.shards]
    assert {f"{r.checksum.replace(':', '-')}.safetensors" for r in records} <= names


def test_a_local_copy_damaged_in_place_is_downloaded_again(s3, remote, tmp_path):
    url, _ = remote
    scratch = tmp_path / "scratch"
    expected = CachedDataset(url)[2]["latents"].clone()
    CachedDataset(url, local_cache=scratch)[2]
    record = CachedDataset(url).manifest.shards[1]
    copy = scratch / "by-checksum" / f"{record.checksum.replace(':', '-')}.safetensors"
    copy.write_bytes(_tampered(copy.read_bytes()))  # same size: found by its checksum
    assert torch.equal(CachedDataset(url, local_cache=scratch)[2]["latents"], expected)
    assert copy.read_bytes() == s3.cat_file(f"{url.removeprefix('s3://')}/{SHARD}")
