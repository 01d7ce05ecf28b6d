"""LiveCache: the first epoch trains on raw batches exactly and writes cache()'s cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphsplit.caching.format.layout import PARTIAL_DIR
from graphsplit.caching.live import LiveCache
from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CacheError, StaleCacheError
from tests.caching.fixtures import (
    ROOT,
    SMALL,
    Interrupt,
    Model,
    Pictures,
    flip_last_byte,
    interrupt_after,
    loader,
    make_split,
    rows_by_key,
    worker_environment,
)
from tests.helpers import two_process_launch

LIVE_WORKER = Path(__file__).with_name("live_worker.py")


def shuffled(dataset=None, seed: int = 3) -> torch.utils.data.DataLoader:
    dataset = Pictures(12) if dataset is None else dataset
    return loader(dataset, shuffle=True, generator=torch.Generator().manual_seed(seed))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    found = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


def unsplit(model: Model, batch, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    loss = model(batch["pixel_values"], batch["input_ids"])
    loss.backward()
    return loss.detach(), grads(model)


def live_step(live: LiveCache, model: Model, batch, seed: int):
    torch.manual_seed(seed)
    loss = live.step(batch)
    loss.backward()
    return loss.detach(), grads(model)


def assert_exact(live: LiveCache, model: Model, batches) -> None:
    for seed, batch in enumerate(batches):
        loss, found = live_step(live, model, batch, seed)
        expected_loss, expected = unsplit(model, batch, seed)
        assert torch.equal(loss, expected_loss)
        assert found.keys() == expected.keys() and found  # the head's parameters
        for name in expected:
            assert torch.equal(found[name], expected[name]), name


# ------------------------------------------------------------------------------------ exactness


def test_the_first_epoch_is_the_unsplit_step_bit_for_bit_and_writes_cache_s_cache(tmp_path):
    split = make_split()
    batches = list(shuffled())
    with LiveCache(split, tmp_path / "live", shard_bytes=SMALL) as live:
        assert_exact(live, split.model, batches)
        assert live.written_samples == 12
    info = live.finish()  # already finished by the block: the same answer
    assert (info.num_samples, info.num_shards, info.written_shards) == (12, 6, 6)
    assert not (tmp_path / "live" / PARTIAL_DIR).exists()
    # The same cache cache() writes, read by the same readers: rows, fingerprint, audit.
    cache(split, loader(Pictures(12)), tmp_path / "pass", shard_bytes=SMALL, progress=False)
    assert_same_rows(rows_by_key(tmp_path / "live"), rows_by_key(tmp_path / "pass"))
    live_manifest = json.loads((tmp_path / "live" / "manifest.json").read_text())
    pass_manifest = json.loads((tmp_path / "pass" / "manifest.json").read_text())
    assert live_manifest["fingerprint"] == pass_manifest["fingerprint"]
    assert check_cache(tmp_path / "live").ok
    assert len(CachedDataset(tmp_path / "live", split)) == 12
    # cache() on the live cache finds it complete: nothing to write.
    again = cache(split, loader(Pictures(12)), tmp_path / "live", shard_bytes=SMALL, progress=False)
    assert again.written_shards == 0


def assert_same_rows(found, expected) -> None:
    assert found.keys() == expected.keys()
    for key, rows in expected.items():
        assert found[key].keys() == rows.keys()
        for name, row in rows.items():
            assert torch.equal(found[key][name], row), (key, name)


def test_later_epochs_read_the_cache_exactly(tmp_path):
    split = make_split()
    with LiveCache(split, tmp_path, shard_bytes=SMALL) as live:
        for batch in shuffled():
            live.step(batch)
    stage1_calls = []
    split.stage1.register_forward_hook(lambda *args: stage1_calls.append(1))
    # Epoch 2 in another order, answered from the cache by key: still the unsplit step.
    assert_exact(live, split.model, list(shuffled(seed=4)))
    assert stage1_calls == []
    # A new LiveCache on the complete folder reads it from the start.
    reopened = LiveCache(split, tmp_path, shard_bytes=SMALL)
    assert reopened.complete and reopened.written_samples == 0
    assert_exact(reopened, split.model, list(shuffled(seed=5))[:2])
    # And the CachedDataset path: stage 2 on collated rows.
    cached = live.dataset()
    batch = next(iter(cached.loader(batch_size=4, seed=0)))
    assert split.stage2(**batch).shape == ()


def test_a_key_seen_twice_before_finishing_is_written_once(tmp_path):
    split = make_split()
    with LiveCache(split, tmp_path, shard_bytes=SMALL) as live:
        for batch in [*shuffled(seed=1), *shuffled(seed=2)]:  # two epochs before finish
            live.step(batch)
        assert live.written_samples == 12
    assert live.finish().num_samples == 12
    assert sorted(CachedDataset(tmp_path).keys) == [f"pic{i:03d}" for i in range(12)]


def test_lossy_storage_records_its_error(tmp_path):
    split = make_split()
    with LiveCache(split, tmp_path, storage_dtype=torch.bfloat16) as live:
        for batch in shuffled():
            live.step(batch)
    info = live.finish()
    assert info.storage_dtype == torch.bfloat16 and info.max_abs_error["latents"] > 0


# ------------------------------------------------------------------------------------- resuming


def test_an_interrupted_epoch_resumes_from_the_committed_shards(tmp_path, monkeypatch):
    split = make_split()
    interrupt_after(monkeypatch, 2)
    with pytest.raises(Interrupt), LiveCache(split, tmp_path, shard_bytes=SMALL) as live:
        for batch in shuffled():
            live.step(batch)
    assert not (tmp_path / "manifest.json").exists()
    assert len(list((tmp_path / PARTIAL_DIR).glob("shard-*.json"))) == 2
    monkeypatch.undo()
    # The epoch starts again (another order): the 4 committed samples are not written again.
    with LiveCache(split, tmp_path, shard_bytes=SMALL) as resumed:
        assert_exact(resumed, split.model, list(shuffled(seed=7)))
        assert resumed.written_samples == 8
    full = tmp_path.parent / "uninterrupted"
    cache(split, loader(Pictures(12)), full, shard_bytes=SMALL, progress=False)
    assert_same_rows(rows_by_key(tmp_path), rows_by_key(full))
    assert check_cache(tmp_path).ok


def test_a_killed_epoch_resumes(tmp_path):
    path = tmp_path / "cache"
    command = [sys.executable, str(LIVE_WORKER), str(path), "--die-after", "3"]
    run = subprocess.run(command, env=worker_environment(), cwd=ROOT, capture_output=True)
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    assert not (path / "manifest.json").exists()
    # The worker kills itself once 3 commits are done, but commits run on a pool: another
    # one may finish between the third and the kill. Every recorded one must be kept.
    survivors = len(list((path / PARTIAL_DIR).glob("shard-*.json")))
    assert survivors >= 3, run.stderr.decode()[-2000:]
    split = make_split()
    with LiveCache(split, path, shard_bytes=SMALL) as live:
        for batch in shuffled():
            live.step(batch)
        assert live.written_samples == 12 - 2 * survivors  # shards of 2 samples are kept
    full = tmp_path / "uninterrupted"
    cache(split, loader(Pictures(12)), full, shard_bytes=SMALL, progress=False)
    assert_same_rows(rows_by_key(path), rows_by_key(full))


@pytest.mark.parametrize(
    ("length", "batches"),
    [(12, [3, 3]), (10, [3, 3])],  # 10: accelerate pads process 1 with samples process 0 has
)
def test_two_accelerate_processes_write_one_cache(tmp_path, length, batches):
    pytest.importorskip("accelerate")
    path = tmp_path / "shared"
    command = two_process_launch(
        str(LIVE_WORKER), str(path), "--accelerate", "--length", str(length)
    )
    run = subprocess.run(command, env=worker_environment(), cwd=ROOT, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    losses = [json.loads(Path(f"{path}.losses.{rank}.json").read_text()) for rank in (0, 1)]
    assert [len(found) for found in losses] == batches
    full = tmp_path / "single"
    cache(make_split(), loader(Pictures(length)), full, shard_bytes=SMALL, progress=False)
    assert_same_rows(rows_by_key(path), rows_by_key(full))
    assert check_cache(path).ok
    assert len(CachedDataset(path).keys) == length  # every key once


def test_shards_are_numbered_in_order_when_a_finished_one_is_redone(tmp_path, monkeypatch):
    split = make_split()
    interrupt_after(monkeypatch, 3)
    with pytest.raises(Interrupt), LiveCache(split, tmp_path, shard_bytes=SMALL) as live:
        for batch in shuffled():
            live.step(batch)
    monkeypatch.undo()
    flip_last_byte(tmp_path / "shard-00001.safetensors")  # damaged: not a finished shard
    with LiveCache(split, tmp_path, shard_bytes=SMALL) as resumed:
        for batch in shuffled(seed=8):
            resumed.step(batch)
        assert resumed.written_samples == 8
    names = sorted(entry.name for entry in tmp_path.glob("shard-*.safetensors"))
    # Shards 0 and 2 were kept; the new ones came after them; all are numbered 0 .. n-1.
    assert names == [f"shard-{index:05d}.safetensors" for index in range(len(names))]
    assert len(names) == len(CachedDataset(tmp_path).manifest.shards) > 3
    assert check_cache(tmp_path).ok
    full = tmp_path.parent / "uninterrupted"
    cache(split, loader(Pictures(12)), full, shard_bytes=SMALL, progress=False)
    assert_same_rows(rows_by_key(tmp_path), rows_by_key(full))


# ---------------------------------------------------------------------------------- refusals


def test_a_folder_holding_another_split_s_cache_is_refused(tmp_path):
    cache(make_split(Model(seed=5)), loader(Pictures(4)), tmp_path, progress=False)
    with pytest.raises(StaleCacheError) as caught:
        LiveCache(make_split(), tmp_path)
    message = str(caught.value)
    assert "holds a graphsplit cache made differently" in message
    assert "overwrite=True" in message
    live = LiveCache(make_split(), tmp_path, overwrite=True)
    assert not live.complete
    live.close()


def test_an_unfinished_cache_of_other_options_is_refused(tmp_path, monkeypatch):
    interrupt_after(monkeypatch, 1)
    with pytest.raises(Interrupt), LiveCache(make_split(), tmp_path, shard_bytes=SMALL) as live:
        for batch in shuffled():
            live.step(batch)
    expected = r"(?s)unfinished cache started differently.*shard_bytes"
    with pytest.raises(StaleCacheError, match=expected):
        LiveCache(make_split(), tmp_path, shard_bytes=SMALL * 2)


def test_a_batch_without_keys_is_refused(tmp_path):
    with pytest.raises(CacheError) as caught, LiveCache(make_split(), tmp_path) as live:
        live.step(next(iter(loader(Pictures(4, keys=False)))))
    assert "needs each batch's sample keys" in str(caught.value)
    assert "unique str 'key'" in str(caught.value)


def test_a_key_that_comes_back_with_other_inputs_is_refused(tmp_path):
    changed = Pictures(4)
    changed.changed[0] = 1.0
    live = LiveCache(make_split(), tmp_path, shard_bytes=SMALL)
    live.step(next(iter(loader(Pictures(4)))))
    live.step(next(iter(loader(changed))))
    with pytest.raises(StaleCacheError, match="'pic000' came again with other inputs"):
        live.finish()


def test_a_key_named_twice_in_one_batch_is_refused(tmp_path):
    batch = next(iter(loader(Pictures(4))))
    batch["key"] = ["same", "same"]
    with pytest.raises(CacheError, match="key twice"), LiveCache(make_split(), tmp_path) as live:
        live.step(batch)


def test_a_sample_the_first_epoch_missed_is_named(tmp_path):
    split = make_split()
    with LiveCache(split, tmp_path) as live:
        live.step(next(iter(loader(Pictures(4)))))
    with pytest.raises(StaleCacheError, match=r"(?s)holds no sample 'pic00[23]'.*did not see it"):
        live.step(list(loader(Pictures(4)))[1])


def test_the_dataset_waits_for_finish_and_buckets_and_empty_runs_are_refused(tmp_path):
    live = LiveCache(make_split(), tmp_path / "a")
    with pytest.raises(CacheError, match=r"(?s)not finished yet.*live.finish\(\)"):
        live.dataset()
    live.close()
    with pytest.raises(CacheError, match=r"(?s)was closed before.*new LiveCache.*resumes"):
        live.step(next(iter(loader(Pictures(4)))))
    with pytest.raises(CacheError, match="local or shared folder"):
        LiveCache(make_split(), "s3://bucket/cache")
    with pytest.raises(CacheError, match="no sample was written"):
        LiveCache(make_split(), tmp_path / "b").finish()


# ------------------------------------------------------------------- a real split of a real step


@pytest.mark.slow  # splitting the SD step: ~1 min on a busy 2-core machine
def test_the_sd_lora_step_trains_exactly_in_both_epochs(tmp_path):
    """The demo's step (VAE distribution resampled in stage 2, noise, timesteps) split by
    graphsplit.split: epoch 1 through LiveCache and epoch 2 from its cache both give the
    unsplit step's losses and LoRA gradients bit for bit."""
    pytest.importorskip("diffusers")
    import graphsplit
    from tests.zoo import CaptionedImages, build_sd_lora_step

    step = build_sd_lora_step(seed=0, size="tiny")
    dataset = CaptionedImages(length=4, resolution=32)
    epoch = loader(dataset, shuffle=True, generator=torch.Generator().manual_seed(0))
    first = next(iter(epoch))
    split = graphsplit.split(step, (first["pixel_values"], first["input_ids"]))

    def check(live: LiveCache, seed: int) -> None:
        for index, batch in enumerate(epoch):
            torch.manual_seed(seed + index)
            loss = live.step(batch)
            loss.backward()
            found = grads(step)
            torch.manual_seed(seed + index)
            expected_loss = step(batch["pixel_values"], batch["input_ids"])
            expected_loss.backward()
            expected = grads(step)
            assert torch.equal(loss.detach(), expected_loss.detach())
            assert found.keys() == expected.keys() and found
            assert all(torch.equal(found[name], expected[name]) for name in expected)

    with LiveCache(split, tmp_path, durable=False) as live:
        check(live, 0)
    check(live, 100)  # epoch 2, another order, from the cache
    assert len(live.dataset()) == 4
