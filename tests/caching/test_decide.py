"""What a cache() call does with its folder: nothing, resume, or start afresh; disk space."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store import file_writes
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CacheError, ManifestError, StaleCacheError
from tests.caching.fixtures import (
    SMALL,
    WORKER,
    Interrupt,
    Pictures,
    cache_contents,
    interrupt_after,
    loader,
    make_split,
    worker_environment,
)

# -------------------------------------------------------------------- rerun on a complete cache


def test_rerun_on_complete_cache_is_a_no_op(split, tmp_path):
    cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    before = (tmp_path / "manifest.json").read_bytes()
    info = cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    assert (info.written_shards, info.reused_shards) == (0, 6)
    assert (tmp_path / "manifest.json").read_bytes() == before


def test_rerun_with_other_weights_refuses_unless_overwrite(split, tmp_path):
    cache(split, loader(), tmp_path, progress=False)
    with torch.no_grad():
        split.model.encoder.conv.weight[0, 0, 0, 0] += 1.0
    with pytest.raises(StaleCacheError, match="frozen weights differ") as caught:
        cache(split, loader(), tmp_path, progress=False)
    assert "overwrite=True" in str(caught.value)
    info = cache(split, loader(), tmp_path, overwrite=True, progress=False)
    assert info.written_shards == info.num_shards
    CachedDataset(tmp_path, split)  # matches the new weights


def test_rerun_with_other_storage_dtype_refuses(split, tmp_path):
    cache(split, loader(), tmp_path, progress=False)
    with pytest.raises(StaleCacheError, match="stores losslessly, this call asks for bfloat16"):
        cache(split, loader(), tmp_path, storage_dtype=torch.bfloat16, progress=False)


def test_rerun_with_more_samples_refuses(split, tmp_path):
    cache(split, loader(Pictures(6)), tmp_path, progress=False)
    with pytest.raises(StaleCacheError, match="holds 6 samples but the loader yields 8"):
        cache(split, loader(Pictures(8)), tmp_path, progress=False)


def test_rerun_on_damaged_complete_cache_refuses(split, tmp_path):
    cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    (tmp_path / "shard-00002.safetensors").unlink()
    with pytest.raises(CacheError, match=r"(?s)shard-00002.safetensors is missing.*check_cache"):
        cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)


def test_overwrite_replaces_a_malformed_manifest(split, tmp_path):
    tmp_path.joinpath("manifest.json").write_text('{"format": "graphsplit-cache", "shards": [')
    with pytest.raises(ManifestError, match="not valid JSON"):
        cache(split, loader(), tmp_path, progress=False)
    cache(split, loader(), tmp_path, overwrite=True, progress=False)
    assert len(CachedDataset(tmp_path)) == 12


def test_overwrite_keeps_foreign_files(split, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    cache(split, loader(), tmp_path, progress=False)
    cache(split, loader(), tmp_path, overwrite=True, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------- resume


def test_resume_after_interruption_equals_uninterrupted(split, tmp_path, monkeypatch):
    cache(split, loader(), tmp_path / "whole", shard_bytes=SMALL, progress=False)
    with monkeypatch.context() as patch:
        interrupt_after(patch, 3)
        with pytest.raises(Interrupt):
            cache(split, loader(), tmp_path / "resumed", shard_bytes=SMALL, progress=False)
    assert not (tmp_path / "resumed" / "manifest.json").exists()
    assert not (tmp_path / "resumed" / ".lock").exists()
    info = cache(split, loader(), tmp_path / "resumed", shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (3, 3)
    assert cache_contents(tmp_path / "resumed") == cache_contents(tmp_path / "whole")
    assert not (tmp_path / "resumed" / ".partial").exists()


def test_resume_redoes_a_damaged_finished_shard(split, tmp_path, monkeypatch):
    cache(split, loader(), tmp_path / "whole", shard_bytes=SMALL, progress=False)
    with monkeypatch.context() as patch:
        interrupt_after(patch, 3)
        with pytest.raises(Interrupt):
            cache(split, loader(), tmp_path / "resumed", shard_bytes=SMALL, progress=False)
    shard = tmp_path / "resumed" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    info = cache(split, loader(), tmp_path / "resumed", shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (2, 4)
    assert cache_contents(tmp_path / "resumed") == cache_contents(tmp_path / "whole")


def test_resume_with_other_options_refuses_unless_overwrite(split, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2)
        with pytest.raises(Interrupt):
            cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    with pytest.raises(StaleCacheError, match=r"(?s)unfinished cache.*shard_bytes=1500"):
        cache(split, loader(), tmp_path, shard_bytes=SMALL * 2, progress=False)
    info = cache(split, loader(), tmp_path, shard_bytes=SMALL * 2, overwrite=True, progress=False)
    assert info.reused_shards == 0 and info.num_shards == 2  # 3 batches of 896 B per shard


def test_resume_with_changed_order_refuses(split, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2)
        with pytest.raises(Interrupt):
            cache(split, list(loader()), tmp_path, shard_bytes=SMALL, progress=False)
    reordered = list(loader())
    reordered[0], reordered[1] = reordered[1], reordered[0]
    with pytest.raises(
        StaleCacheError, match=r"4 sample\(s\) moved .*'pic000'.*shard\(s\) \[0, 1\]"
    ):
        cache(split, reordered, tmp_path, shard_bytes=SMALL, progress=False)


def test_resume_with_changed_dataset_indices_refuses(split, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2)
        with pytest.raises(Interrupt):
            cache(split, loader(batch_size=2), tmp_path, shard_bytes=SMALL, progress=False)
    reversed_batches = torch.utils.data.DataLoader(
        Pictures(), batch_sampler=[[11 - i, 10 - i] for i in range(0, 12, 2)]
    )
    with pytest.raises(StaleCacheError, match="cannot resume"):
        cache(split, reversed_batches, tmp_path, shard_bytes=SMALL, progress=False)


def test_duplicate_keys_across_a_resumed_run_are_refused(split, tmp_path, monkeypatch):
    batches = list(loader(Pictures(6)))
    with monkeypatch.context() as patch:
        interrupt_after(patch, 1)
        with pytest.raises(Interrupt):
            cache(split, batches, tmp_path, shard_bytes=SMALL, progress=False)
    batches[2]["key"] = [batches[0]["key"][0], "other"]  # a key of the finished shard 0
    with pytest.raises(CacheError, match=r"(?s)1 sample key\(s\) more than once: 'pic000'"):
        cache(split, batches, tmp_path, shard_bytes=SMALL, progress=False)


@pytest.mark.parametrize("name", ["header.json", "plan.json"])  # plan.json: graphsplit 0.1's name
def test_a_damaged_resume_header_refuses_unless_overwrite(split, tmp_path, monkeypatch, name):
    with monkeypatch.context() as patch:
        interrupt_after(patch, 1)
        with pytest.raises(Interrupt):
            cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    (tmp_path / ".partial" / "header.json").unlink()
    (tmp_path / ".partial" / name).write_text("[]")
    stem = name.removesuffix(".json")
    with pytest.raises(ManifestError, match=rf"{stem}\.json is not a valid graphsplit cache file"):
        cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    info = cache(split, loader(), tmp_path, shard_bytes=SMALL, overwrite=True, progress=False)
    assert info.reused_shards == 0


def test_a_run_interrupted_under_graphsplit_0_1_resumes(split, tmp_path, monkeypatch):
    """graphsplit 0.1 named the resume header .partial/plan.json; its progress records are
    today's, byte for byte (see test_format)."""
    cache(split, loader(), tmp_path / "whole", shard_bytes=SMALL, progress=False)
    with monkeypatch.context() as patch:
        interrupt_after(patch, 3)
        with pytest.raises(Interrupt):
            cache(split, loader(), tmp_path / "resumed", shard_bytes=SMALL, progress=False)
    partial = tmp_path / "resumed" / ".partial"
    assert not (partial / "plan.json").exists()
    (partial / "header.json").rename(partial / "plan.json")  # as 0.1 left it
    info = cache(split, loader(), tmp_path / "resumed", shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (3, 3)
    assert cache_contents(tmp_path / "resumed") == cache_contents(tmp_path / "whole")
    assert not partial.exists()


def test_kill_9_mid_run_then_resume_equals_an_uninterrupted_cache(tmp_path):
    cache(make_split(), loader(Pictures(16)), tmp_path / "whole", shard_bytes=SMALL, progress=False)
    target = tmp_path / "killed"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), str(target), "--length", "16", "--delay", "0.4"],
        env=worker_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    third = target / ".partial" / "shard-00002.json"
    while not third.exists():
        assert worker.poll() is None, worker.stderr.read().decode()
        assert time.monotonic() < deadline, "the worker wrote no shards in 60 s"
        time.sleep(0.05)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    worker.stderr.close()
    assert worker.returncode == -signal.SIGKILL
    assert not (target / "manifest.json").exists()
    assert (target / ".lock").exists()  # left behind by the killed writer: stale

    info = cache(make_split(), loader(Pictures(16)), target, shard_bytes=SMALL, progress=False)
    assert info.reused_shards >= 3 and info.written_shards >= 1
    assert info.reused_shards + info.written_shards == 8
    assert cache_contents(target) == cache_contents(tmp_path / "whole")
    assert sorted(entry.name for entry in target.iterdir()) == sorted(
        entry.name for entry in (tmp_path / "whole").iterdir()
    )


# ----------------------------------------------------------------------------------- disk space


def test_refuses_when_the_disk_lacks_room(split, tmp_path, monkeypatch):
    monkeypatch.setattr(file_writes, "free_bytes", lambda folder: 1000)
    with pytest.raises(CacheError, match=r"(?s)not enough disk space.*needs about.*only 1000 B"):
        cache(split, loader(), tmp_path, progress=False)
    assert not list(tmp_path.glob("shard-*"))


def test_disk_estimate_is_bytes_per_sample_times_samples(split, tmp_path, monkeypatch):
    # per sample: 448 bytes of rows (specs) + 64 per tensor + 256 of headers and manifest
    needed = 12 * (448 + 2 * 64 + 256)
    monkeypatch.setattr(file_writes, "free_bytes", lambda folder: needed - 1)
    with pytest.raises(CacheError, match=r"12 samples x 832 B"):
        cache(split, loader(), tmp_path, progress=False)
    monkeypatch.setattr(file_writes, "free_bytes", lambda folder: needed)
    assert cache(split, loader(), tmp_path, progress=False).num_samples == 12
