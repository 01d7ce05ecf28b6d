"""A cache of a split whose stage 2 pairs its batch's rows by position: the stage-1 batches are
recorded (``paired_rows`` in the header, ``batch_rows`` per shard) and read back whole.

The step is a tiny preference loss that really pairs rows by position (a frozen encoder, a
trainable head, ``score.chunk(2)`` then ``chosen - rejected``), so a regrouped batch would give
another loss; ``split.paired_rows`` is set by hand, but for the last test, where the detector
(:mod:`graphsplit.row_pairing`) finds it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphsplit
from graphsplit.artifacts import PairedRows
from graphsplit.caching.format.layout import ShardProgress
from graphsplit.caching.loader.batches import source_for
from graphsplit.caching.read.bucket_sampler import BucketBatchSampler
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.read.whole_batches import WholeBatchSampler, stage1_batches
from graphsplit.caching.store.record_files import read_manifest, read_shard_progress
from graphsplit.caching.write.cache_run import cache
from graphsplit.caching.write.live_duplicates import drop_repeated_rows
from graphsplit.caching.write.processes import Processes
from graphsplit.caching.write.shards import write_shards
from graphsplit.errors import CacheError, ManifestError, StaleCacheError
from graphsplit.integrations.trainer_groups import refuse_paired_rows
from graphsplit.signatures.defaults import batch_input_names

SOURCE = "preference_step.py:12"
SAMPLES, BATCH = 10, 4  # stage-1 batches of 4, 4 and a short last one of 2


class PreferenceStep(torch.nn.Module):
    """``[chosen rows; rejected rows]``: row i pairs with row i + batch/2."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(6, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        score = self.head(torch.tanh(self.encoder(features))).squeeze(-1)
        chosen, rejected = score.chunk(2)
        return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


def _data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"features": torch.randn(6, generator=generator)} for _ in range(SAMPLES)]


def _loader(data, batch_size: int = BATCH):
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def _split(step, data, *, paired: bool = True):
    """A split of the step with ``paired_rows`` set by hand: as found, under a fixed
    ``source``; or None, as for a step that pairs no rows (the detector would find this
    step's pairing: tests/test_row_pairing.py checks it, the last test here uses it)."""
    split = graphsplit.split(step, (next(iter(_loader(data)))["features"],))
    if paired:
        groups = ((0, 2), (1, 3))
        split.paired_rows = PairedRows(op="sub.Tensor", source=SOURCE, groups=groups, rows=4)
    else:
        split.paired_rows = None
    return split


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    return PreferenceStep()


@pytest.fixture(scope="module")
def paired_cache(tmp_path_factory, step):
    """A paired cache of 10 samples, one stage-1 batch per shard (shard_bytes=1)."""
    data = _data()
    path = tmp_path_factory.mktemp("paired")
    cache(_split(step, data), _loader(data), path, shard_bytes=1, progress=False)
    return path


# ---------------------------------------------------------------------------- the manifest


def test_the_manifest_records_pairing_and_each_stage1_batch(paired_cache, step):
    document = json.loads((paired_cache / "manifest.json").read_text())
    assert document["paired_rows"] == {
        "op": "sub.Tensor",
        "source": SOURCE,
        "groups": [[0, 2], [1, 3]],
        "rows": 4,
    }
    assert [shard["batch_rows"] for shard in document["shards"]] == [[4], [4], [2]]
    manifest = read_manifest(paired_cache)
    assert manifest.header.paired_rows == _split(step, _data()).paired_rows
    assert stage1_batches(manifest) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))


def test_an_ordinary_cache_has_neither_field(tmp_path, step):
    data = _data()
    cache(_split(step, data, paired=False), _loader(data), tmp_path, progress=False)
    text = (tmp_path / "manifest.json").read_text()
    assert "paired_rows" not in text and "batch_rows" not in text
    cached = CachedDataset(tmp_path, _split(step, data, paired=False))
    assert cached.paired_rows is None and cached.stage1_batches is None
    assert len(list(cached.loader(batch_size=3))) == 4  # rows regroup freely


def test_several_batches_in_one_shard_are_recorded_apart(tmp_path, step):
    data = _data()
    cache(_split(step, data), _loader(data), tmp_path, progress=False)  # one shard
    manifest = read_manifest(tmp_path)
    assert [shard.batch_rows for shard in manifest.shards] == [(4, 4, 2)]
    assert stage1_batches(manifest) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))


def _rewrite(path, change) -> None:
    document = json.loads((path / "manifest.json").read_text())
    change(document)
    (path / "manifest.json").write_text(json.dumps(document))


def _copy(paired_cache, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(paired_cache, copy)
    return copy


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d["shards"][0].update(batch_rows=[3]), "adds up to 3 rows"),
        (lambda d: d["shards"][1].pop("batch_rows"), "lacks batch_rows"),
        (lambda d: d["shards"][0].update(batch_rows=[0, 4]), "expected an integer >= 1"),
        (lambda d: d.pop("paired_rows"), "without paired_rows"),
        (lambda d: d["paired_rows"].update(groups=[[0, 9]]), "outside the example's 4"),
        (lambda d: d["paired_rows"].update(extra=1), "unexpected field"),
    ],
)
def test_the_strict_reader_refuses_inconsistent_fields(paired_cache, tmp_path, change, words):
    copy = _copy(paired_cache, tmp_path)
    _rewrite(copy, change)
    with pytest.raises(ManifestError, match=words):
        read_manifest(copy)


# ------------------------------------------------------------------------ stage 2, bit for bit


def test_stage2_on_the_loaders_batches_is_the_eager_step_bit_for_bit(paired_cache, step):
    data = _data()
    split = _split(step, data)
    cached = CachedDataset(paired_cache, split)
    loader = cached.loader(batch_size=BATCH, seed=5)
    order = loader.batch_sampler.epoch_batches(0)
    assert sorted(map(tuple, order)) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert order != sorted(order)  # shuffled as whole batches
    for indices, batch in zip(order, loader, strict=True):
        raw = torch.stack([data[index]["features"] for index in indices])
        assert torch.equal(split.stage2(**batch), step(raw))
    # The same rows regrouped (first and last swapped) pair other samples: another loss.
    indices = [3, 1, 2, 0]
    regrouped = graphsplit.collate([cached[index] for index in indices])
    raw = torch.stack([data[index]["features"] for index in range(4)])
    assert not torch.equal(split.stage2(**regrouped), step(raw))


# ----------------------------------------------------------------------------------- refusals


def test_another_batch_size_is_refused_naming_the_line_and_the_size(paired_cache, step):
    cached = CachedDataset(paired_cache, _split(step, _data()))
    with pytest.raises(CacheError) as refused:
        cached.loader(batch_size=2)
    message = str(refused.value)
    assert SOURCE in message and "by position" in message
    assert "pair the wrong rows" in message
    assert "loader(batch_size=4)" in refused.value.fix.words


def test_a_bucket_sampler_over_a_paired_cache_is_refused(paired_cache):
    cached = CachedDataset(paired_cache)
    with pytest.raises(CacheError) as refused:
        BucketBatchSampler(cached, batch_size=4)
    assert SOURCE in str(refused.value) and "BucketBatchSampler" in str(refused.value)
    assert "cached.loader(batch_size=4)" in refused.value.fix.words


def test_the_hugging_face_export_of_a_paired_cache_is_refused(paired_cache, tmp_path):
    pytest.importorskip("datasets")
    from graphsplit.caching.read.hf_export import export_cache, to_hf_dataset
    from graphsplit.caching.read.hf_record import HFExportError

    for export in (
        lambda: to_hf_dataset(paired_cache),
        lambda: export_cache(paired_cache, tmp_path / "out"),
    ):
        with pytest.raises(HFExportError) as refused:
            export()
        assert SOURCE in str(refused.value) and "export" in str(refused.value)
        assert "loader(batch_size=4)" in refused.value.fix.words
    assert not (tmp_path / "out").exists()


def test_split_trainer_refuses_a_split_that_pairs_rows(step):
    with pytest.raises(CacheError) as refused:
        refuse_paired_rows(_split(step, _data()))
    assert SOURCE in str(refused.value) and "split_trainer" in str(refused.value)
    assert "CachedDataset(path, split).loader" in refused.value.fix.words
    refuse_paired_rows(_split(step, _data(), paired=False))  # an ordinary split passes


# ------------------------------------------------------------------ old caches, stale, resume


def test_a_cache_made_before_the_pairing_was_known_is_refused_with_the_remedy(tmp_path, step):
    data = _data()
    cache(_split(step, data, paired=False), _loader(data), tmp_path, progress=False)
    paired = _split(step, data)
    with pytest.raises(StaleCacheError) as refused:
        CachedDataset(tmp_path, paired)
    assert SOURCE in str(refused.value) and "stage-1 batches" in str(refused.value)
    assert "overwrite=True" in str(refused.value)
    with pytest.raises(StaleCacheError, match="without recording its stage-1") as refused:
        cache(paired, _loader(data), tmp_path, progress=False)
    assert "overwrite=True" in str(refused.value)
    cache(paired, _loader(data), tmp_path, progress=False, overwrite=True)
    assert CachedDataset(tmp_path, paired).stage1_batches == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))


def test_a_paired_cache_is_kept_for_a_split_not_known_to_pair(paired_cache, tmp_path, step):
    copy = _copy(paired_cache, tmp_path)
    data = _data()
    before = (copy / "manifest.json").read_bytes()
    cache(_split(step, data, paired=False), _loader(data), copy, shard_bytes=1, progress=False)
    assert (copy / "manifest.json").read_bytes() == before
    cached = CachedDataset(copy, _split(step, data, paired=False))
    assert isinstance(cached.loader(batch_size=4).batch_sampler, WholeBatchSampler)


class _Interrupted(Exception):
    pass


def _stopping(data, after: int):
    for index, batch in enumerate(_loader(data)):
        if index == after:
            raise _Interrupted
        yield batch


class _Stopping(torch.utils.data.IterableDataset):
    """The loader's batches, stopping with an error at batch ``after``."""

    def __init__(self, data, after: int) -> None:
        self.data, self.after = data, after

    def __iter__(self):
        return _stopping(self.data, self.after)


def test_a_resumed_run_writes_the_batches_of_an_uninterrupted_one(paired_cache, tmp_path, step):
    data = _data()
    folder = tmp_path / "resumed"
    stopping = torch.utils.data.DataLoader(_Stopping(data, after=2), batch_size=None)
    with pytest.raises(_Interrupted):
        cache(_split(step, data), stopping, folder, shard_bytes=1, progress=False)
    assert (folder / ".partial").is_dir() and not (folder / "manifest.json").exists()
    with pytest.raises(StaleCacheError, match="unfinished cache started differently"):
        cache(_split(step, data), _loader(data), folder, shard_bytes=2, progress=False)
    cache(_split(step, data), _loader(data), folder, shard_bytes=1, progress=False)
    resumed, whole = read_manifest(folder), read_manifest(paired_cache)
    assert resumed.header.paired_rows == whole.header.paired_rows
    assert [s.batch_rows for s in resumed.shards] == [s.batch_rows for s in whole.shards]


def test_an_unfinished_unpaired_cache_is_not_resumed_as_paired(tmp_path, step):
    data = _data()
    stopping = torch.utils.data.DataLoader(_Stopping(data, after=2), batch_size=None)
    with pytest.raises(_Interrupted):
        cache(_split(step, data, paired=False), stopping, tmp_path, shard_bytes=1, progress=False)
    with pytest.raises(StaleCacheError, match="without recording its stage-1 batches"):
        cache(_split(step, data), _loader(data), tmp_path, shard_bytes=1, progress=False)


# ----------------------------------------------------------------------------- the live cache


def _keyed(data, batch_size: int = BATCH):
    for start in range(0, len(data), batch_size):
        rows = data[start : start + batch_size]
        yield {
            "features": torch.stack([row["features"] for row in rows]),
            "key": [str(start + offset) for offset in range(len(rows))],
        }


def test_a_live_cache_records_each_batch_and_refuses_one_known_in_part(tmp_path, step):
    data = _data()
    split = _split(step, data)
    with graphsplit.LiveCache(split, tmp_path, shard_bytes=1) as live:
        for batch in _keyed(data):
            assert torch.equal(live.step(batch), step(batch["features"]))
    manifest = read_manifest(tmp_path)
    assert manifest.header.paired_rows == split.paired_rows
    assert stage1_batches(manifest) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))
    folder = tmp_path / "part"
    with graphsplit.LiveCache(split, folder, shard_bytes=1) as live:
        live.step(next(_keyed(data)))
        live._writer.commit()  # the first batch's shard is finished: its keys are known
        with pytest.raises(CacheError, match="cannot store part of one") as refused:
            live.step(next(_keyed(data[2:], batch_size=4)) | {"key": ["2", "3", "x", "y"]})
    assert SOURCE in str(refused.value) and "overwrite=True" in str(refused.value)


# ---------------------------------------------------------------------------------- the sampler

batch_lists = st.lists(st.integers(1, 5), min_size=0, max_size=12).map(
    lambda sizes: [tuple(range(sum(sizes[:n]), sum(sizes[: n + 1]))) for n in range(len(sizes))]
)


@settings(max_examples=150, deadline=None)
@given(
    batches=batch_lists,
    replicas=st.integers(1, 4),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 3),
)
def test_every_epoch_gives_whole_batches_across_replicas(
    batches, replicas, drop_last, shuffle, seed, epoch
):
    samplers = [
        WholeBatchSampler(
            batches,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_replicas=replicas,
            rank=rank,
        )
        for rank in range(replicas)
    ]
    shares = [sampler.epoch_batches(epoch) for sampler in samplers]
    assert {len(share) for share in shares} == {len(samplers[0])}  # the same count everywhere
    given_out = [tuple(batch) for share in shares for batch in share]
    assert set(given_out) <= set(batches)  # whole stage-1 batches, rows in their order
    longest = max(map(len, batches), default=0)
    kept = [batch for batch in batches if not drop_last or len(batch) == longest]
    counts = {batch: given_out.count(batch) for batch in kept}
    if drop_last:
        assert all(count <= 1 for count in counts.values())  # nothing twice
        assert len(given_out) == len(kept) // replicas * replicas
    else:
        assert all(count >= 1 for count in counts.values())  # every sample each epoch
        assert len(given_out) - len(kept) == -len(kept) % replicas  # padding only
        if len(kept) % replicas == 0:
            assert all(count == 1 for count in counts.values())
    again = WholeBatchSampler(batches, shuffle=shuffle, seed=seed, drop_last=drop_last)
    assert again.epoch_batches(epoch) == WholeBatchSampler(
        batches, shuffle=shuffle, seed=seed, drop_last=drop_last
    ).epoch_batches(epoch)  # a pure function of seed and epoch
    if not shuffle:
        assert [tuple(b) for b in again.epoch_batches(epoch)] == kept


@settings(max_examples=60, deadline=None)
@given(batches=batch_lists, seed=st.integers(0, 100), stop=st.integers(0, 12))
def test_a_sampler_resumes_mid_epoch(batches, seed, stop):
    sampler = WholeBatchSampler(batches, seed=seed)
    full = list(WholeBatchSampler(batches, seed=seed))
    stop = min(stop, max(len(full) - 1, 0))  # mid-epoch (after the last, the next epoch is due)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(stop)]
    state = sampler.state_dict()
    resumed = WholeBatchSampler(batches, seed=seed)
    resumed.load_state_dict(state)
    assert taken + list(resumed) == full


def test_seeds_and_epochs_give_other_orders():
    batches = [tuple(range(start, start + 2)) for start in range(0, 40, 2)]
    first = WholeBatchSampler(batches, seed=0).epoch_batches(0)
    assert first != WholeBatchSampler(batches, seed=1).epoch_batches(0)
    assert first != WholeBatchSampler(batches, seed=0).epoch_batches(1)
    sampler = WholeBatchSampler(batches, seed=0)
    assert list(sampler) == first and sampler.state_dict()["epoch"] == 1
    other = WholeBatchSampler(batches, seed=1)
    with pytest.raises(CacheError, match="another order"):
        other.load_state_dict(sampler.state_dict())


def test_a_sampler_over_an_ordinary_cache_says_what_to_use(tmp_path, step):
    data = _data()
    cache(_split(step, data, paired=False), _loader(data), tmp_path, progress=False)
    with pytest.raises(ValueError, match="records no stage-1 batches"):
        WholeBatchSampler(CachedDataset(tmp_path))


def test_each_process_records_the_batches_of_its_own_shards(paired_cache, tmp_path, step):
    """Two processes (rank 0 owns shards 0 and 2, rank 1 shard 1) write what one process wrote."""
    data, whole = _data(), read_manifest(paired_cache)
    split = _split(step, data)
    written = {}
    for rank in (0, 1):
        processes = Processes(SimpleNamespace(process_index=rank, num_processes=2))
        source = source_for(_loader(data), batch_input_names(split))
        header = whole.header
        mine = write_shards(
            split, source, tmp_path, header=header, finished={}, processes=processes, progress=False
        )
        written.update({index: progress.shard.batch_rows for index, progress in mine.items()})
    assert sorted(written) == [0, 1, 2]
    for index, shard in enumerate(whole.shards):
        assert read_shard_progress(tmp_path, index, whole.header).shard == shard


def test_a_batch_two_live_processes_both_wrote_in_part_is_refused(paired_cache):
    whole = read_manifest(paired_cache)
    first = whole.shards[0]  # keys "0".."3", one batch of 4
    digests = first.input_sha256
    other = dataclasses.replace(
        first,
        file="shard-00001.safetensors",
        keys=("2", "3", "x", "y"),
        input_sha256=(digests[2], digests[3], digests[0], digests[1]),
    )
    records = [
        (index, ShardProgress(shard=shard, positions=(0, 1, 2, 3), max_abs_error={}))
        for index, shard in enumerate((first, other))
    ]
    with pytest.raises(CacheError, match="2 of the 4 rows of a stage-1 batch") as refused:
        drop_repeated_rows(paired_cache, whole.header, records, durable=False)
    assert SOURCE in str(refused.value) and "even_batches=False" in str(refused.value)


def test_an_export_read_back_with_a_split_that_pairs_rows_is_refused(tmp_path, step):
    pytest.importorskip("datasets")
    from graphsplit.caching.read.hf_export import HFCachedDataset, to_hf_dataset

    data = _data()
    cache(_split(step, data, paired=False), _loader(data), tmp_path, progress=False)
    exported = to_hf_dataset(tmp_path)
    with pytest.raises(StaleCacheError, match="without recording its stage-1 batches"):
        HFCachedDataset(exported, _split(step, data))
    assert len(HFCachedDataset(exported, _split(step, data, paired=False))) == SAMPLES


def test_the_pairing_the_detector_finds_is_recorded_and_read_whole(tmp_path, step):
    data = _data()
    split = graphsplit.split(step, (next(iter(_loader(data)))["features"],))
    assert split.paired_rows is not None and split.paired_rows.groups == ((0, 2), (1, 3))
    cache(split, _loader(data), tmp_path, progress=False)
    cached = CachedDataset(tmp_path, split)
    assert cached.paired_rows == split.paired_rows
    assert sorted(map(tuple, cached.loader(batch_size=BATCH).batch_sampler)) == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9),
    ]
