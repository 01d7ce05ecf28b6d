"""graphsplit.cache: writing, layout, resume, lock, disk space, storage dtype, refusals."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import types
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import graphsplit.caching.run as cache_module
from graphsplit.caching.dataset import CachedDataset, collate
from graphsplit.caching.format import read_manifest
from graphsplit.caching.run import CacheInfo, cache
from graphsplit.errors import CacheError, CacheLockedError, ManifestError, StaleCacheError
from tests._cache_fixtures import (
    Pictures,
    bucket_batches,
    cache_contents,
    loader,
    make_split,
    rows_by_key,
)

SMALL = 1500  # bytes: one batch of two samples per shard


@pytest.fixture
def split():
    return make_split()


def stage1_rows(split, dataset, indices):
    """The rows stage 1 computes for ``indices``, straight from the model."""
    items = [dataset[i] for i in indices]
    pixels = torch.stack([item["pixel_values"] for item in items])
    ids = torch.stack([item["input_ids"] for item in items])
    return split.stage1(pixels, ids)


# ----------------------------------------------------------------------------------- round trip


def test_round_trip_rows_constants_and_loss(split, tmp_path):
    dataset = Pictures(12)
    info = cache(split, loader(dataset), tmp_path / "c", shard_bytes=SMALL, progress=False)
    assert isinstance(info, CacheInfo)
    assert (info.num_samples, info.num_shards, info.written_shards) == (12, 6, 6)
    cached = CachedDataset(tmp_path / "c", split)
    assert len(cached) == 12 and cached[3]["key"] == "pic003"
    assert cached[0]["text"].shape == (6, 8)  # batch dim 1 dropped from the row
    batch = collate([cached[4], cached[5]])
    assert list(batch) == ["latents", "text", "table"]
    expected = stage1_rows(split, dataset, [4, 5])
    for name in expected:
        assert torch.equal(batch[name], expected[name]), name
    # stage 2 on the cache gives bit for bit the unsplit model's loss and gradients
    model = split.model
    torch.manual_seed(7)
    loss = split.stage2(**batch)
    loss.backward()
    cached_grads = [p.grad.clone() for p in model.head.parameters()]
    model.zero_grad()
    items = [dataset[4], dataset[5]]
    torch.manual_seed(7)
    reference = model(
        torch.stack([i["pixel_values"] for i in items]),
        torch.stack([i["input_ids"] for i in items]),
    )
    reference.backward()
    assert torch.equal(loss, reference)
    for grad, parameter in zip(cached_grads, model.head.parameters()):
        assert torch.equal(grad, parameter.grad)


def test_folder_layout_and_manifest(split, tmp_path):
    info = cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    names = sorted(entry.name for entry in tmp_path.iterdir())
    assert names == ["constants.safetensors", "manifest.json"] + [
        f"shard-{k:05d}.safetensors" for k in range(6)
    ]
    manifest = read_manifest(tmp_path)
    assert manifest.header.layout.batches_per_shard == 1
    assert manifest.shards[0].keys == ("pic000", "pic001")
    assert manifest.shards[0].shapes[0] == ((4, 4, 4), (6, 8))
    assert len(manifest.shards[0].input_sha256[0]) == 64
    document = json.loads((tmp_path / "manifest.json").read_text())
    assert document["format"] == "graphsplit-cache" and document["format_version"] == 1
    assert document["fingerprint"]["versions"]["torch"] == torch.__version__
    assert info.total_bytes == sum(
        (tmp_path / f).stat().st_size for f in names if f.endswith(".safetensors")
    )


def test_shards_hold_whole_batches_of_about_shard_bytes(split, tmp_path):
    cache(split, loader(batch_size=2), tmp_path, shard_bytes=4 * 448 + 10, progress=False)
    shards = read_manifest(tmp_path).shards
    assert [len(shard.keys) for shard in shards] == [4, 4, 4]


def test_keys_default_to_dataset_indices(split, tmp_path):
    cache(split, loader(Pictures(4, keys=False)), tmp_path, progress=False)
    assert CachedDataset(tmp_path).keys == ["0", "1", "2", "3"]


def test_any_iterable_of_batches_gives_the_same_cache(split, tmp_path):
    cache(split, loader(), tmp_path / "loader", shard_bytes=SMALL, progress=False)
    batches = list(loader())
    cache(split, batches, tmp_path / "list", shard_bytes=SMALL, progress=False)
    assert cache_contents(tmp_path / "loader") == cache_contents(tmp_path / "list")


def test_tuple_batches_follow_input_names(split, tmp_path):
    batches = [(b["pixel_values"], b["input_ids"]) for b in loader(Pictures(4, keys=False))]
    cache(split, batches, tmp_path, progress=False)
    cached = CachedDataset(tmp_path)
    expected = stage1_rows(split, Pictures(4), [2, 3])
    assert torch.equal(collate([cached[2], cached[3]])["latents"], expected["latents"])


def test_variable_shapes_two_resolutions(split, tmp_path):
    dataset = Pictures(10, sizes=(8, 12))
    batches = bucket_batches(dataset, 2)
    bucketed = torch.utils.data.DataLoader(dataset, batch_sampler=batches)
    cache(split, bucketed, tmp_path, shard_bytes=SMALL, progress=False)
    cached = CachedDataset(tmp_path, split)
    by_key = {key: i for i, key in enumerate(cached.keys)}
    for indices in batches:
        expected = stage1_rows(split, dataset, indices)
        got = collate([cached[by_key[f"pic{i:03d}"]] for i in indices])
        for name in expected:
            assert torch.equal(got[name], expected[name])
    assert cached.shapes(by_key["pic001"]) == {"latents": (4, 6, 6), "text": (6, 8)}
    assert cached.sample_shapes[by_key["pic000"]]["latents"] == (4, 4, 4)
    groups = cached.buckets()
    assert sorted(len(group) for group in groups.values()) == [5, 5]


# ------------------------------------------------------------------------------ rerun behaviour


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
    tmp_path.joinpath("manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        cache(split, loader(), tmp_path, progress=False)
    cache(split, loader(), tmp_path, overwrite=True, progress=False)
    assert len(CachedDataset(tmp_path)) == 12


def test_overwrite_keeps_foreign_files(split, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    cache(split, loader(), tmp_path, progress=False)
    cache(split, loader(), tmp_path, overwrite=True, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------- resume


class Interrupt(Exception):
    pass


def interrupt_after(monkeypatch, shards: int) -> None:
    """Make the writer fail after ``shards`` shards were committed, like a crash."""
    original = cache_module._ShardWriter._commit_shard
    done = []

    def commit(self, shard, temporary):
        if len(done) >= shards:
            raise Interrupt("simulated crash")
        done.append(shard.index)
        return original(self, shard, temporary)

    monkeypatch.setattr(cache_module._ShardWriter, "_commit_shard", commit)


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
    with pytest.raises(StaleCacheError, match="other samples for shard 0"):
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


# --------------------------------------------------------------------------------------- lock


def write_lock(folder: Path, **owner) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"since": "earlier", **owner}))


def test_lock_held_by_a_live_process_refuses(split, tmp_path):
    write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname())
    with pytest.raises(
        CacheLockedError, match=rf"being written by process {os.getpid()}"
    ) as caught:
        cache(split, loader(), tmp_path, progress=False)
    assert "delete" in str(caught.value) and ".lock" in str(caught.value)
    assert (tmp_path / ".lock").exists()  # not ours to remove


def test_lock_of_another_host_refuses(split, tmp_path):
    write_lock(tmp_path, pid=1, host="elsewhere")
    with pytest.raises(CacheLockedError, match="on host 'elsewhere'"):
        cache(split, loader(), tmp_path, progress=False)


def test_unreadable_lock_refuses(split, tmp_path):
    tmp_path.joinpath(".lock").write_text("garbage")
    with pytest.raises(CacheLockedError, match="unknown process"):
        cache(split, loader(), tmp_path, progress=False)


def test_stale_lock_of_a_dead_process_is_taken_over(split, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, pid=dead.pid, host=socket.gethostname())
    cache(split, loader(), tmp_path, progress=False)
    assert not (tmp_path / ".lock").exists()


def test_lock_is_held_while_writing(split, tmp_path, monkeypatch):
    seen = []
    original = cache_module._write_shards

    def spy(*args, **kwargs):
        seen.append(json.loads((tmp_path / ".lock").read_text()))
        return original(*args, **kwargs)

    monkeypatch.setattr(cache_module, "_write_shards", spy)
    cache(split, loader(), tmp_path, progress=False)
    assert seen[0]["pid"] == os.getpid() and seen[0]["host"] == socket.gethostname()


# --------------------------------------------------------------------------------- disk space


def test_refuses_when_the_disk_lacks_room(split, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(10**6, 0, 1000))
    with pytest.raises(CacheError, match=r"(?s)not enough disk space.*needs about.*only 1000 B"):
        cache(split, loader(), tmp_path, progress=False)
    assert not list(tmp_path.glob("shard-*"))


def test_full_disk_while_writing_gives_a_clear_error(split, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module, "save_file", full)
    with pytest.raises(CacheError, match=r"(?s)ran full while writing.*finished shards are kept"):
        cache(split, loader(Pictures(4, keys=False)), tmp_path, progress=False)


def test_disk_estimate_is_bytes_per_sample_times_samples(split, tmp_path, monkeypatch):
    # per sample: 448 bytes of rows (specs) + 64 per tensor + 256 of headers and manifest
    usage = namedtuple("usage", "total used free")
    needed = 12 * (448 + 2 * 64 + 256)
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(0, 0, needed - 1))
    with pytest.raises(CacheError, match=r"12 samples x 832 B"):
        cache(split, loader(), tmp_path, progress=False)
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(0, 0, needed))
    assert cache(split, loader(), tmp_path, progress=False).num_samples == 12


# ------------------------------------------------------------------------------ storage dtype


def test_bfloat16_storage_records_its_error_and_collate_restores_dtype(split, tmp_path):
    info = cache(split, loader(), tmp_path, storage_dtype=torch.bfloat16, progress=False)
    assert info.storage_dtype == torch.bfloat16
    assert set(info.max_abs_error) == {"latents", "text", "table"}
    assert all(0 < error < 0.1 for error in info.max_abs_error.values())
    assert "max abs error" in str(info)
    cached = CachedDataset(tmp_path, split)
    assert cached[0]["latents"].dtype == torch.bfloat16
    assert cached.max_abs_error == info.max_abs_error
    batch = collate([cached[0], cached[1]])
    assert batch["latents"].dtype == torch.float32 and batch["table"].dtype == torch.float32
    exact = stage1_rows(split, Pictures(), [0, 1])
    for name in exact:
        assert (batch[name] - exact[name]).abs().max() <= info.max_abs_error[name]


def test_float16_overflow_is_refused(tmp_path):
    split = make_split(scale=1e6)  # the constant table exceeds float16's range
    with pytest.raises(CacheError, match=r"(?s)'table' holds values up to .*beyond the range"):
        cache(split, loader(), tmp_path, storage_dtype=torch.float16, progress=False)


@pytest.mark.parametrize("bad", [torch.int8, torch.float64, "bfloat16"])
def test_invalid_storage_dtype(split, tmp_path, bad):
    with pytest.raises(ValueError, match="storage_dtype must be None"):
        cache(split, loader(), tmp_path, storage_dtype=bad)


def test_invalid_shard_bytes(split, tmp_path):
    with pytest.raises(ValueError, match="shard_bytes must be a positive integer"):
        cache(split, loader(), tmp_path, shard_bytes=0)


# ------------------------------------------------------------------------------ loader refusals


def test_shuffled_loader_is_refused(split, tmp_path):
    with pytest.raises(CacheError, match=r"(?s)shuffles.*RandomSampler.*shuffle=False"):
        cache(split, loader(shuffle=True), tmp_path)


def test_prepared_loader_is_refused(split, tmp_path):
    Prepared = type("DataLoaderShard", (), {"__module__": "accelerate.data_loader"})
    with pytest.raises(CacheError, match="pass the plain DataLoader and the accelerator"):
        cache(split, Prepared(), tmp_path)


def test_duplicate_keys_are_refused(split, tmp_path):
    batches = list(loader(Pictures(4)))
    batches[1]["key"] = batches[0]["key"]
    with pytest.raises(CacheError, match=r"(?s)sample key 'pic000' twice.*unique 'key'"):
        cache(split, batches, tmp_path, progress=False)


def test_batches_lacking_an_input_are_refused(split, tmp_path):
    batches = [{"pixel_values": b["pixel_values"], "key": b["key"]} for b in loader()]
    with pytest.raises(CacheError, match=r"lack \['input_ids'\]"):
        cache(split, batches, tmp_path, progress=False)


def test_batches_of_the_wrong_type_are_refused(split, tmp_path):
    with pytest.raises(CacheError, match="a batch is a Tensor"):
        cache(split, [torch.zeros(2, 3)], tmp_path, progress=False)


def test_keys_of_the_wrong_length_are_refused(split, tmp_path):
    batches = list(loader(Pictures(4)))
    batches[0]["key"] = ["only-one"]
    with pytest.raises(CacheError, match=r"'key' lists 1 key\(s\) but its inputs hold 2 samples"):
        cache(split, batches, tmp_path, progress=False)
    indexed = torch.utils.data.DataLoader(Pictures(4), batch_size=2, collate_fn=one_key)
    with pytest.raises(CacheError, match=r"one key per sample \(2 here\)"):
        cache(split, indexed, tmp_path, progress=False)


def one_key(items):
    batch = torch.utils.data.default_collate(items)
    batch["key"] = batch["key"][:1]
    return batch


def test_empty_loader_is_refused(split, tmp_path):
    with pytest.raises(CacheError, match="yielded no batches"):
        cache(split, [], tmp_path / "list", progress=False)
    with pytest.raises(CacheError, match="yielded no batches"):
        cache(split, loader(Pictures(0)), tmp_path / "loader", progress=False)
    assert not (tmp_path / "loader" / ".partial").exists()


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


def test_batches_of_unknown_size_are_refused(split, tmp_path):
    with pytest.raises(CacheError, match="cannot tell how many samples a batch holds"):
        cache(split, [{"pixel_values": [1.0], "input_ids": 3}], tmp_path, progress=False)


def test_duplicate_keys_across_a_resumed_run_are_refused(split, tmp_path, monkeypatch):
    batches = list(loader(Pictures(6)))
    with monkeypatch.context() as patch:
        interrupt_after(patch, 1)
        with pytest.raises(Interrupt):
            cache(split, batches, tmp_path, shard_bytes=SMALL, progress=False)
    batches[2]["key"] = [batches[0]["key"][0], "other"]  # a key of the finished shard 0
    with pytest.raises(CacheError, match=r"(?s)1 sample key\(s\) more than once: 'pic000'"):
        cache(split, batches, tmp_path, shard_bytes=SMALL, progress=False)


def test_a_damaged_resume_record_refuses_unless_overwrite(split, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        interrupt_after(patch, 1)
        with pytest.raises(Interrupt):
            cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    (tmp_path / ".partial" / "plan.json").write_text("[]")
    with pytest.raises(ManifestError, match=r"plan\.json is not a valid graphsplit cache file"):
        cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    info = cache(split, loader(), tmp_path, shard_bytes=SMALL, overwrite=True, progress=False)
    assert info.reused_shards == 0


# ----------------------------------------------------------------------------------- progress


def test_progress_bar_shows_samples_and_bytes(split, tmp_path, capsys):
    cache(split, loader(), tmp_path / "a", shard_bytes=SMALL, progress=True)
    err = capsys.readouterr().err
    assert "12/12" in err and "sample" in err and "KiB written" in err


def test_progress_bar_is_quiet_off_a_terminal_and_when_disabled(split, tmp_path, capsys):
    cache(split, loader(), tmp_path / "a", progress=None)  # pytest's stderr is not a TTY
    cache(split, loader(), tmp_path / "b", progress=False)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------- real split


def _core_available() -> bool:
    try:
        import graphsplit

        return callable(getattr(graphsplit, "split", None))
    except Exception:
        return False


class InlineStep(torch.nn.Module):
    """A step written inline (frozen encoders + trainable head), for the real splitter."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.vae = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.text = torch.nn.Embedding(50, 8)
        self.unet = torch.nn.Linear(4, 4)
        self.words = torch.nn.Linear(8, 4)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        self.vae.requires_grad_(False)
        self.text.requires_grad_(False)

    def forward(self, pixel_values, input_ids):
        latents = self.vae(pixel_values) * 0.18
        states = self.text(input_ids)
        noisy = latents + torch.randn_like(latents)
        prediction = self.unet(noisy.mean(dim=(2, 3))) + self.words(states.mean(dim=1))
        return (prediction - latents.mean(dim=(2, 3))).pow(2).mean()


@pytest.mark.skipif(not _core_available(), reason="graphsplit.split is not available yet")
def test_round_trip_with_a_real_split(tmp_path):
    import graphsplit

    model = InlineStep()
    dataset = Pictures(8)
    example = next(iter(loader(dataset, batch_size=2)))
    real = graphsplit.split(model, args=(example["pixel_values"], example["input_ids"]))
    cache(real, loader(dataset, batch_size=4), tmp_path, progress=False)
    cached = CachedDataset(tmp_path, real)
    for indices in ([0, 1, 2, 3], [6, 7]):
        items = [dataset[i] for i in indices]
        pixels = torch.stack([i["pixel_values"] for i in items])
        ids = torch.stack([i["input_ids"] for i in items])
        torch.manual_seed(3)
        reference = model(pixels, ids)
        reference.backward()
        expected = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        torch.manual_seed(3)
        loss = real.stage2(**collate([cached[i] for i in indices]))
        loss.backward()
        assert torch.equal(loss, reference)
        got = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        model.zero_grad()


@pytest.mark.skipif(not _core_available(), reason="graphsplit.split is not available yet")
def test_round_trip_of_a_real_sd_step_is_bit_exact(tmp_path):
    """Frozen VAE + text encoder, LoRA UNet: stage 2 on the cache == the unsplit step."""
    pytest.importorskip("diffusers")
    import graphsplit
    from tests.zoo import CaptionedImages, build_sd_lora_step

    step = build_sd_lora_step(seed=0)
    dataset = CaptionedImages(length=6, resolution=32)
    batches = torch.utils.data.DataLoader(dataset, batch_size=2)
    example = next(iter(batches))
    real = graphsplit.split(step, (example["pixel_values"], example["input_ids"]))
    cache(real, batches, tmp_path, progress=False)
    cached = CachedDataset(tmp_path, real, dataset=dataset)
    trainable = [p for p in step.parameters() if p.requires_grad]
    for indices in ([0, 1], [4, 5]):
        batch = collate([cached[i] for i in indices])
        torch.manual_seed(11)
        loss = real.stage2(**batch)
        grads = torch.autograd.grad(loss, trainable)
        items = [dataset[i] for i in indices]
        torch.manual_seed(11)
        reference = step(
            torch.stack([i["pixel_values"] for i in items]),
            torch.stack([i["input_ids"] for i in items]),
        )
        assert torch.equal(loss, reference)
        expected = torch.autograd.grad(reference, trainable)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected))


class ChannelsLastEncoder(torch.nn.Module):
    """Stage 1 whose output is channels-last, like a VAE on CPU can be."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)

    def forward(self, pixel_values):
        return {"latents": self.conv(pixel_values).contiguous(memory_format=torch.channels_last)}


def test_memory_layout_of_stage1_outputs_survives_the_cache(tmp_path):
    from graphsplit.artifacts import BoundarySpec
    from tests._cache_fixtures import trace

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
    with pytest.raises(CacheError, match="stored in different memory layouts"):
        collate([cached[0], odd])


def channels_last_strides(shape):
    return torch.empty(shape).contiguous(memory_format=torch.channels_last).stride()


def test_memory_order_of_common_layouts():
    from graphsplit.caching.format import memory_order

    channels_last = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    assert memory_order(channels_last) == (0, 2, 3, 1)
    assert memory_order(channels_last[:1]) == (0, 2, 3, 1)
    assert memory_order(torch.randn(3, 2, 5).transpose(0, 1)) == (1, 0, 2)
    assert memory_order(torch.randn(3, 4)) is None
    assert memory_order(torch.randn(3, 1).expand(3, 4)) is None  # not dense: read as contiguous
    assert memory_order(torch.randn(4, 6)[:, ::2]) is None


def test_rows_by_key_helper_reads_every_sample(split, tmp_path):
    cache(split, loader(Pictures(4)), tmp_path, progress=False)
    rows = rows_by_key(tmp_path)
    assert sorted(rows) == ["pic000", "pic001", "pic002", "pic003"]
    assert set(rows["pic002"]) == {"latents", "text"}
