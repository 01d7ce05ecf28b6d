"""Writing shards: rows per batch, memory layout, stage 1's outputs checked, a full disk."""

from __future__ import annotations

import os
import threading
import types
from pathlib import Path

import pytest
import torch

from graphsplit.caching.format.input_digests import batch_input_digests
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store import file_writes
from graphsplit.caching.store.record_files import read_manifest
from graphsplit.caching.write.cache_run import cache
from graphsplit.caching.write.shards import ShardWriter
from graphsplit.errors import CacheError
from tests.caching.fixtures import (
    SMALL,
    ChannelsLastEncoder,
    Interrupt,
    Pictures,
    cache_contents,
    interrupt_after,
    loader,
    make_split,
    short_name,
)

# ------------------------------------------------------------------------------ rows and shards


def test_shards_hold_whole_batches_of_about_shard_bytes(split, tmp_path):
    cache(split, loader(batch_size=2), tmp_path, shard_bytes=4 * 448 + 10, progress=False)
    shards = read_manifest(tmp_path).shards
    assert [len(shard.keys) for shard in shards] == [4, 4, 4]


def test_memory_layout_of_stage1_outputs_survives_the_cache(tmp_path):
    from graphsplit.artifacts import BoundarySpec
    from tests.caching.fixtures import trace

    encoder = ChannelsLastEncoder()
    split = types.SimpleNamespace(
        stage1=trace(encoder),
        boundary={
            "latents": BoundarySpec("latents", (2, 4, 8, 8), torch.float32, 0, 1024, "x"),
        },
        input_names=("pixel_values",),
    )
    dataset = Pictures(5)  # batches of 2, 2 and 1: a batch of one has no batch stride
    cache(split, loader(dataset), tmp_path, progress=False)
    cached = CachedDataset(tmp_path)
    assert read_manifest(tmp_path).shards[0].row_orders[0] == ((0, 2, 3, 1),)
    for indices in ([0, 1], [4]):  # as cached: the loader's batches
        batch = collate([cached[i] for i in indices])["latents"]
        pixels = torch.stack([dataset[i]["pixel_values"] for i in indices])
        expected = split.stage1(pixels)["latents"]
        assert torch.equal(batch, expected) and batch.stride() == expected.stride()
        torch.manual_seed(0)  # randn_like fills memory in order: same layout, same noise
        noise = torch.randn_like(batch)
        torch.manual_seed(0)
        assert torch.equal(noise, torch.randn_like(expected))
    mixed = collate([cached[3], cached[4]])["latents"]  # rows of a batch of 2 and one of 1
    assert mixed.stride() == channels_last_strides(mixed.shape)
    assert torch.equal(mixed[1], collate([cached[4]])["latents"][0])
    odd = cached[1]
    odd.dim_orders = ((0, 3, 1, 2),)
    with pytest.raises(CacheError, match="stored in different memory layouts") as caught:
        collate([cached[0], odd])
    # The message names each layout's samples, the cause and the fix.
    message = str(caught.value)
    assert f"for {cached[0]['key']!r}" in message and f"for {odd['key']!r}" in message
    assert "batches of different sizes" in message and "drop_last=True" in message


def channels_last_strides(shape):
    return torch.empty(shape).contiguous(memory_format=torch.channels_last).stride()


# ---------------------------------------------------------------------------- stage 1's outputs


def test_wrong_stage1_outputs_are_refused(split, tmp_path):
    split.boundary = {**split.boundary, "extra": split.boundary["latents"]}
    with pytest.raises(CacheError, match=r"stage 1 returned \['latents', 'table', 'text'\]"):
        cache(split, loader(), tmp_path, progress=False)


def test_batch_dim_mismatch_is_refused(split, tmp_path):
    spec = split.boundary["text"]
    split.boundary["text"] = type(spec)("text", spec.shape, spec.dtype, 0, 1, "x")
    with pytest.raises(CacheError, match=r"'text' with shape \(6, 2, 8\), whose batch dim 0"):
        cache(split, loader(Pictures(3)), tmp_path, progress=False)


class Altered(torch.nn.Module):
    """The fixture's stage 1 with its outputs changed by ``alter``, to provoke errors."""

    def __init__(self, stage1, alter) -> None:
        super().__init__()
        self.stage1, self.alter, self.code = stage1, alter, stage1.code

    def forward(self, pixel_values, input_ids):
        return self.alter(self.stage1(pixel_values, input_ids), pixel_values)


def test_non_tensor_outputs_are_refused(split, tmp_path):
    split.stage1 = Altered(split.stage1, lambda out, pixels: {**out, "table": 3.0})
    with pytest.raises(CacheError, match="stage 1 returned a float for 'table', not a tensor"):
        cache(split, loader(), tmp_path, progress=False)


def test_a_constant_that_changes_between_batches_is_refused(split, tmp_path):
    def alter(out, pixels):
        return {**out, "table": out["table"] + pixels.sum()}

    split.stage1 = Altered(split.stage1, alter)
    with pytest.raises(CacheError, match="constant 'table' differs between batches"):
        cache(split, loader(), tmp_path, progress=False)


def test_float16_overflow_is_refused(tmp_path):
    split = make_split(scale=1e6)  # the constant table exceeds float16's range
    with pytest.raises(
        CacheError, match=r"(?s)'table' holds values up to .*beyond the range"
    ) as caught:
        cache(split, loader(), tmp_path, storage_dtype=torch.float16, progress=False)
    from graphsplit.errors import Remedy, Wording, speaking

    assert caught.value.remedy is Remedy.STORE_BFLOAT16  # decided by type, never by text
    assert "fix:    use storage_dtype=torch.bfloat16" in str(caught.value)
    with speaking(Wording.CLI):
        assert "fix:    use --storage-dtype bfloat16" in str(caught.value)


def test_duplicate_keys_are_refused(split, tmp_path):
    batches = list(loader(Pictures(4)))
    batches[1]["key"] = batches[0]["key"]
    with pytest.raises(CacheError, match=r"(?s)sample key 'pic000' twice.*unique 'key'"):
        cache(split, batches, tmp_path, progress=False)


class _UnshardedStream(torch.utils.data.IterableDataset):
    """Ignores get_worker_info(): every worker of a DataLoader yields every sample."""

    def __iter__(self):
        pictures = Pictures(2)
        return (pictures[index] for index in range(len(pictures)))


def test_repeated_keys_from_unsharded_workers_name_the_workers_and_the_fix(split, tmp_path):
    streamed = torch.utils.data.DataLoader(_UnshardedStream(), batch_size=2, num_workers=2)
    with pytest.raises(CacheError, match="sample key 'pic000' twice") as caught:
        cache(split, streamed, tmp_path, progress=False)
    message = str(caught.value)
    assert "runs 2 workers over an IterableDataset" in message
    assert "get_worker_info()" in message and "num_workers=0" in message


# ------------------------------------------------------------------------ durability and cost


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names descriptors via /proc")
def test_files_are_fsynced_before_publishing_and_progress_records_are_not(split, tmp_path):
    synced: list[str] = []
    original = os.fsync

    def fsync(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        original(descriptor)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(file_writes.os, "fsync", fsync)
        cache(split, loader(batch_size=2), tmp_path, shard_bytes=4 * 448 + 10, progress=False)
    names = [short_name(Path(name).name) for name in synced]
    shards = [f".shard-0000{index}.safetensors.tmp" for index in range(3)]
    assert set(shards) <= set(names) and ".manifest.json.tmp" in names
    assert names.index(".manifest.json.tmp") > max(names.index(shard) for shard in shards)
    assert str(tmp_path) in synced  # the folder, once the renames are in it
    assert not [name for name in names if name.startswith(".shard-") and ".json" in name]


def test_an_empty_progress_record_means_its_shard_is_redone(split, tmp_path, monkeypatch):
    """What a power cut can leave of a record written without fsync: resuming redoes it."""
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2)
        with pytest.raises(Interrupt):
            cache(split, loader(batch_size=2), tmp_path, shard_bytes=4 * 448 + 10, progress=False)
    (tmp_path / ".partial" / "shard-00001.json").write_bytes(b"")
    info = cache(split, loader(batch_size=2), tmp_path, shard_bytes=4 * 448 + 10, progress=False)
    assert (info.reused_shards, info.written_shards) == (1, 2)
    assert not (tmp_path / ".partial").exists()
    assert len(CachedDataset(tmp_path)) == 12


class RefillingLoader:
    """A re-iterable that refills one buffer per input for every batch, as a loader with a
    preallocated (pinned) buffer may: a batch's tensors change once the next is asked for."""

    def __init__(self, dataset: Pictures, batch_size: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.refilled: list[threading.Event] = []  # [k]: batch k's buffers hold batch k + 1

    def __iter__(self):
        buffers = None
        for number, start in enumerate(range(0, len(self.dataset), self.batch_size)):
            batch = torch.utils.data.default_collate(
                [self.dataset[i] for i in range(start, start + self.batch_size)]
            )
            if buffers is None:
                buffers = {name: value.clone() for name, value in batch.items() if name != "key"}
            for name, buffer in buffers.items():
                buffer.copy_(batch[name])
            if number:
                self.refilled[number - 1].set()
            self.refilled.append(threading.Event())
            yield {**buffers, "key": batch["key"]}
        self.refilled[-1].set()


def test_input_digests_are_those_of_each_batch_as_yielded(split, tmp_path, monkeypatch):
    """The digests run on another thread; the batch they hash is a copy, so a loader that
    refills its buffers meanwhile changes nothing (hashing waits here until it has)."""
    dataset = Pictures(12)
    refilling = RefillingLoader(dataset, 2)
    calls = []

    def digests_once_refilled(batch, names, size):
        calls.append(threading.current_thread().name)
        assert refilling.refilled[len(calls) - 1].wait(timeout=60)
        return batch_input_digests(batch, names, size)

    monkeypatch.setattr(
        "graphsplit.caching.write.shards.batch_input_digests", digests_once_refilled
    )
    info = cache(split, refilling, tmp_path, progress=False)
    names = split.input_names
    expected = [d for batch in loader(dataset) for d in batch_input_digests(batch, names, 2)]
    assert [d for shard in read_manifest(info.path).shards for d in shard.input_sha256] == expected
    assert len(set(expected)) == 12 and set(calls) == {"graphsplit-digest_0"}


def test_a_failing_input_digest_stops_the_run_with_its_error(split, tmp_path, monkeypatch):
    def failing(*args):
        raise CacheError("cannot digest this input")

    monkeypatch.setattr("graphsplit.caching.write.shards.batch_input_digests", failing)
    with pytest.raises(CacheError, match="cannot digest this input"):
        cache(split, loader(), tmp_path, progress=False)
    assert not (tmp_path / "manifest.json").exists()


def test_a_slow_disk_holds_the_writer_back_at_two_unsynced_shards(split, tmp_path, monkeypatch):
    """Each shard's fsync overlaps the writing of the next, but a shard is handed on only
    while fewer than two wait for theirs: on a disk slower than stage 1, the writer waits
    instead of piling up written, unsynced shards (and stage 1 waits for the writer)."""
    whole = tmp_path / "whole"
    cache(split, loader(), whole, shard_bytes=SMALL, progress=False)
    lock = threading.Lock()
    written: list[int] = []
    synced: list[int] = []
    waiting_at_save: list[int] = []  # shards written but not yet committed, at each save
    save, commit = ShardWriter.save, ShardWriter.commit

    def saving(self, shard):
        with lock:
            waiting_at_save.append(len(written) - len(synced))
        result = save(self, shard)
        with lock:
            written.append(shard.index)
        return result

    def committing(self, shard, temporary, checksum):
        threading.Event().wait(0.05)  # a slow fsync: the writer could run ahead meanwhile
        result = commit(self, shard, temporary, checksum)
        with lock:
            synced.append(shard.index)
        return result

    monkeypatch.setattr(ShardWriter, "save", saving)
    monkeypatch.setattr(ShardWriter, "commit", committing)
    info = cache(split, loader(), tmp_path / "slow", shard_bytes=SMALL, progress=False)
    assert info.num_shards == 6 and cache_contents(tmp_path / "slow") == cache_contents(whole)
    assert max(waiting_at_save) == 2 and sorted(synced) == list(range(6))
