"""Stage 2 over a cache of several shapes: ``CachedDataset.loader`` and ``BucketBatchSampler``.

Each test reads a real cache written by ``graphsplit.cache`` (the hand-made split over pictures
of three sizes, an SD-1.5 LoRA step split by ``graphsplit.split`` over three aspect buckets,
and one on a local S3 server) and checks the batches by their outcome: one shape each, every
sample once, the same batches for the same seed and epoch, the rest of an epoch on resume,
disjoint equal shares across processes, and stage-2 losses bit-equal to the unsplit step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import graphsplit
from graphsplit.caching.read.bucket_sampler import BucketBatchSampler, BucketLoader
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CacheError
from tests.caching.fixtures import Pictures, bucket_batches, make_split, worker_environment
from tests.helpers import free_port

SIZES = (8, 12, 16)
SAMPLES = 23  # 8 + 8 + 7 pictures: with batches of 3, every bucket ends with a shorter batch
BUCKET_WORKER = Path(__file__).with_name("bucket_worker.py")


def _write_mixed(path, samples: int = SAMPLES) -> Path:
    dataset = Pictures(samples, sizes=SIZES)
    bucketed = torch.utils.data.DataLoader(dataset, batch_sampler=bucket_batches(dataset, 2))
    cache(make_split(), bucketed, path, progress=False)
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> CachedDataset:
    """A cache of 23 pictures in three sizes, written by graphsplit.cache."""
    return CachedDataset(_write_mixed(tmp_path_factory.mktemp("mixed")), make_split())


def _shapes(cached: CachedDataset, batch: list[int]) -> set[tuple]:
    return {tuple(cached.shapes(index).values()) for index in batch}


# ------------------------------------------------------------------------ one epoch, one process


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_have_one_shape_and_cover_the_epoch(mixed, drop_last):
    sampler = BucketBatchSampler(mixed, batch_size=3, seed=1, drop_last=drop_last)
    batches = list(sampler)
    assert len(batches) == len(sampler) == (6 if drop_last else 9)
    assert all(len(_shapes(mixed, batch)) == 1 for batch in batches)
    counts = Counter(index for batch in batches for index in batch)
    assert set(counts.values()) == {1}  # no sample twice
    if drop_last:  # every batch full; each bucket's last 2, 2 and 1 samples left out
        assert {len(batch) for batch in batches} == {3} and len(counts) == SAMPLES - 5
    else:  # every sample; each bucket's last batch is shorter
        assert len(counts) == SAMPLES
        assert sorted(len(batch) for batch in batches) == [1, 2, 2, 3, 3, 3, 3, 3, 3]
    for batch in batches:  # collate takes every batch
        stacked = collate([mixed[index] for index in batch])
        assert stacked["latents"].shape[0] == len(batch)


def test_the_loader_trains_stage2_over_every_batch(mixed):
    loader = mixed.loader(batch_size=4, seed=0)
    assert isinstance(loader, BucketLoader) and loader.collate_fn is collate
    seen = []
    for batch in loader:
        assert set(batch) == {"latents", "text", "table"}  # the constant added to every batch
        assert torch.isfinite(make_split().stage2(**batch))
        seen.append(batch["latents"].shape[0])
    assert sum(seen) == SAMPLES and len(seen) == len(loader)


def test_the_same_seed_and_epoch_give_the_same_batches(mixed):
    first = BucketBatchSampler(mixed, 3, seed=5)
    again = BucketBatchSampler(mixed, 3, seed=5)
    epochs = [list(first) for _ in range(3)]  # each full pass starts the next epoch
    assert [list(again) for _ in range(3)] == epochs
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != epochs[2]
    for epoch, batches in enumerate(epochs):
        assert first.epoch_batches(epoch) == batches
        fresh = BucketBatchSampler(mixed, 3, seed=5)
        fresh.set_epoch(epoch)
        assert list(fresh) == batches
    assert list(BucketBatchSampler(mixed, 3, seed=6)) != epochs[0]


def test_without_shuffle_buckets_and_samples_keep_their_order(mixed):
    batches = list(BucketBatchSampler(mixed, 3, shuffle=False))
    flat = [index for batch in batches for index in batch]
    groups = mixed.buckets()
    assert flat == [i for shape in sorted(groups, key=repr) for i in groups[shape]]


def test_buckets_may_be_given_directly():
    buckets = {"small": [0, 1, 2], "large": [3, 4]}
    batches = list(BucketBatchSampler(buckets, 2, shuffle=False))
    assert batches == [[3, 4], [0, 1], [2]]
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler(buckets, 0)
    with pytest.raises(ValueError, match="rank 2"):
        BucketBatchSampler(buckets, 2, num_replicas=2, rank=2)


# ------------------------------------------------------------------------------------- resuming


def test_resuming_mid_epoch_gives_the_rest_without_reading_the_skipped(mixed, monkeypatch):
    sampler = BucketBatchSampler(mixed, 3, seed=2)
    sampler.set_epoch(4)
    expected = sampler.epoch_batches(4)
    iterator = iter(sampler)
    done = [next(iterator) for _ in range(4)]
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (4, 4) and done == expected[:4]

    resumed = BucketBatchSampler(mixed, 3, seed=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    resumed.set_epoch(4)  # the training loop's own call keeps the restored position
    read: list[int] = []
    reading = CachedDataset.__getitem__
    monkeypatch.setattr(
        CachedDataset, "__getitem__", lambda self, i: read.append(i) or reading(self, i)
    )
    loader = torch.utils.data.DataLoader(mixed, batch_sampler=resumed, collate_fn=collate)
    rest = [batch["latents"].shape[0] for batch in loader]
    assert rest == [len(batch) for batch in expected[4:]]
    assert read == [index for batch in expected[4:] for index in batch]  # nothing skipped read
    assert (resumed.epoch, resumed.position) == (5, 0)  # the epoch is done: the next is due
    resumed.set_epoch(7)
    assert list(resumed) == sampler.epoch_batches(7)


def test_the_loader_counts_delivered_batches_while_workers_prefetch(mixed):
    context = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None
    loader = mixed.loader(
        batch_size=2, seed=0, num_workers=2, prefetch_factor=2, multiprocessing_context=context
    )
    expected = loader.batch_sampler.epoch_batches(0)
    states = [loader.state_dict()["position"] for _ in zip(range(5), loader)]
    assert states == [1, 2, 3, 4, 5]  # not the sampler's count, which runs ahead of the loop
    again = mixed.loader(batch_size=2, seed=0)
    again.load_state_dict({"epoch": 0, "position": 3})
    keys = [batch["latents"].shape[0] for batch in again]
    assert keys == [len(batch) for batch in expected[3:]]


def test_a_state_for_another_order_is_refused(mixed):
    state = BucketBatchSampler(mixed, 3, seed=2, num_replicas=2, rank=0).state_dict()
    other = BucketBatchSampler(mixed, 4, seed=3, num_replicas=2, rank=1)
    with pytest.raises(CacheError, match=r"(?s)seed 2 \(now 3\), batch_size 3 \(now 4\).*fix:"):
        other.load_state_dict(state)
    with pytest.raises(CacheError, match=r"num_replicas 2 \(now 1\)"):
        BucketBatchSampler(mixed, 3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="position 99"):
        BucketBatchSampler(mixed, 3, seed=2, num_replicas=2).load_state_dict(
            {**state, "position": 99}
        )


# ------------------------------------------------------------------------ across processes


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_processes_get_equal_disjoint_shares_of_one_epoch(mixed, world, drop_last):
    samplers = [
        BucketBatchSampler(mixed, 3, seed=9, drop_last=drop_last, num_replicas=world, rank=rank)
        for rank in range(world)
    ]
    shares = [sampler.epoch_batches(0) for sampler in samplers]
    assert len({len(share) for share in shares}) == 1  # no process waits on the others
    assert all(len(share) == len(sampler) for share, sampler in zip(shares, samplers))
    alone = BucketBatchSampler(mixed, 3, seed=9, drop_last=drop_last).epoch_batches(0)
    # step i of every process trains consecutive batches of the one global list
    together = [share[step] for step in range(len(shares[0])) for share in shares]
    batches = len(alone)
    if drop_last:  # truncated: nothing twice, at most world - 1 batches left out
        assert together == alone[: batches - batches % world]
        counts = Counter(index for batch in together for index in batch)
        assert set(counts.values()) == {1}
    else:  # padded with the list's first batches: every sample, at most world - 1 repeats
        padding = -batches % world
        assert together == alone + alone[:padding]
        covered = {index for batch in together for index in batch}
        assert covered == set(range(SAMPLES))
    assert all(len(_shapes(mixed, batch)) == 1 for share in shares for batch in share)


def test_the_state_is_the_same_on_every_process(mixed):
    samplers = [BucketBatchSampler(mixed, 3, num_replicas=3, rank=rank) for rank in range(3)]
    iterators = [iter(sampler) for sampler in samplers]
    for iterator in iterators:
        next(iterator), next(iterator)
    assert len({json.dumps(sampler.state_dict()) for sampler in samplers}) == 1


@pytest.mark.slow
def test_two_accelerate_processes_share_an_epoch_by_default(mixed, tmp_path):
    pytest.importorskip("accelerate")
    report = tmp_path / "report"
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"),
        *("--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"),
        *("--dynamo_backend", "no", "--main_process_port", str(free_port())),
        *(str(BUCKET_WORKER), str(mixed.path), str(report)),
    ]
    finished = subprocess.run(command, env=worker_environment(), capture_output=True, timeout=240)
    assert finished.returncode == 0, finished.stderr.decode()[-4000:]
    reports = [json.loads(Path(f"{report}.{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["num_replicas"], r["sampler_rank"]) for r in reports] == [(2, 0), (2, 1)]
    assert (
        len(reports[0]["batches"]) == len(reports[1]["batches"]) == 5
    )  # 9 batches of 3, padded to 10
    assert all(batch["processes"] == 2 for r in reports for batch in r["batches"])
    keys = [batch["keys"] for r in reports for batch in r["batches"]]
    assert {key for batch in keys for key in batch} == set(mixed.keys)
    counts = Counter(key for batch in keys for key in batch)
    twice = {key for key, count in counts.items() if count == 2}
    assert max(counts.values()) == 2 and twice in [set(batch) for batch in keys]  # the padding
    for r in reports:
        for batch in r["batches"]:
            assert batch["shapes"]["latents"][0] == len(batch["keys"])
        assert (r["state"]["epoch"], r["state"]["position"]) == (1, 0)
    assert reports[0]["state"] == reports[1]["state"]


# --------------------------------------------------------------------------- the shape refusal


def test_plain_collate_names_the_bucket_loader_as_its_fix(mixed):
    first, other = next(iter(mixed.buckets().values()))[0], list(mixed.buckets().values())[1][0]
    with pytest.raises(CacheError, match=r"(?s)different shapes.*fix:.*cached\.loader\(batch"):
        collate([mixed[first], mixed[other]])


# ------------------------------------------------------------------------------- remote caches


def test_a_remote_cache_trains_through_its_loader(s3, bucket, mixed):
    url = f"s3://{bucket}/mixed"
    _write_mixed(url)
    remote = CachedDataset(url, make_split())
    local_batches = [batch for batch in mixed.loader(batch_size=3, seed=4)]
    remote_batches = [batch for batch in remote.loader(batch_size=3, seed=4)]
    assert len(remote_batches) == len(local_batches) == 9
    for got, expected in zip(remote_batches, local_batches):
        assert all(torch.equal(got[name], expected[name]) for name in expected)


# -------------------------------------------------------- a real split over three aspect buckets


def test_sd_lora_over_three_aspect_buckets_is_bit_equal_to_the_unsplit_step(tmp_path):
    zoo = pytest.importorskip("tests.zoo")
    step = zoo.build_sd_lora_step()
    # 4 images a bucket, batches of 2 in stage 1 and stage 2: a CPU VAE's output layout
    # depends on the batch size (channels-last at 2, contiguous at 1), and stage 2 rebuilds the
    # layout its rows were computed in, so only batches of stage 1's size match the unsplit step
    data = zoo.CaptionedImages(length=12, resolutions=[32, 40, 48])
    example = torch.utils.data.default_collate([data[0], data[3]])
    split = graphsplit.split(step, args=(example["pixel_values"], example["input_ids"]))
    sides = [[i for i in range(len(data)) if data.resolution_of(i) == s] for s in (32, 40, 48)]
    batches = [group[i : i + 2] for group in sides for i in range(0, len(group), 2)]
    graphsplit.cache(
        split, torch.utils.data.DataLoader(data, batch_sampler=batches), tmp_path, progress=False
    )
    cached = graphsplit.CachedDataset(tmp_path, split)
    assert len(cached.buckets()) == 3
    sampler = graphsplit.BucketBatchSampler(cached, batch_size=2, seed=11)
    loader = torch.utils.data.DataLoader(cached, batch_sampler=sampler, collate_fn=collate)
    by_key = {data[i]["key"]: i for i in range(len(data))}
    losses = 0
    for step_index, (indices, batch) in enumerate(zip(sampler.epoch_batches(0), loader)):
        torch.manual_seed(step_index)
        loss = split.stage2(**batch)
        raw = torch.utils.data.default_collate([data[by_key[cached.keys[i]]] for i in indices])
        torch.manual_seed(step_index)
        unsplit = step(raw["pixel_values"], raw["input_ids"])
        assert torch.equal(loss, unsplit), (step_index, loss.item(), unsplit.item())
        losses += 1
    assert losses == 6  # two batches per bucket
