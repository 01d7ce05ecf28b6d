"""Reading a cache: CachedDataset, collate, staleness, verify_inputs, never unpickling."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch

import graphsplit.caching.read.dataset as dataset_module
from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.collation import CachedSample, collate
from graphsplit.caching.read.dataset import CachedDataset, verify_inputs
from graphsplit.caching.store.regular_files import checksum_file
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CacheError, CorruptCacheError, StaleCacheError
from tests.caching.fixtures import (
    Pictures,
    loader,
    make_split,
    rewrite_manifest,
    trace,
)

# -------------------------------------------------------------------------------------- reading


def test_items_are_dicts_of_rows_with_keys(path):
    cached = CachedDataset(path)
    item = cached[5]
    assert isinstance(item, dict) and isinstance(item, CachedSample)
    assert item["key"] == "pic005" and set(item) == {"key", "latents", "text"}
    assert cached[-1]["key"] == "pic011"
    with pytest.raises(IndexError, match="sample 12 is out of range for a cache of 12"):
        cached[12]
    assert set(cached.constants) == {"table"}


def test_reads_in_dataloader_workers(path):
    cached = CachedDataset(path)
    cached[0]  # opens a shard in this process first
    workers = torch.utils.data.DataLoader(
        cached, batch_size=4, shuffle=True, num_workers=2, collate_fn=collate
    )
    single = torch.utils.data.DataLoader(cached, batch_size=12, collate_fn=collate)
    total = sum(batch["latents"].sum() for batch in workers)
    assert torch.allclose(total, next(iter(single))["latents"].sum())
    pickle.loads(pickle.dumps(cached))[3]  # open handles are not pickled


def test_verify_false_skips_checksums_but_still_checks_headers(path):
    shard = path / "shard-00001.safetensors"
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    cached = CachedDataset(path, verify=False)
    with pytest.raises(CorruptCacheError, match="its header is not JSON"):
        cached[2]
    assert cached[0]["key"] == "pic000"


def test_no_warnings_on_a_clean_read(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached = CachedDataset(path, make_split())
        collate([cached[0], cached[1]])
    assert dataset_module.CachedDataset is CachedDataset


# -------------------------------------------------------------------------------------- collate


def test_collate_refuses_mixed_shapes(tmp_path):
    split = make_split()
    dataset = Pictures(4, sizes=(8, 12))
    batches = torch.utils.data.DataLoader(dataset, batch_sampler=[[0, 2], [1, 3]])
    cache(split, batches, tmp_path, progress=False)
    cached = CachedDataset(tmp_path)
    with pytest.raises(
        CacheError,
        match=r"(?s)cannot batch 'latents'.*\(4, 4, 4\) for 'pic000'.*"
        r"\(4, 6, 6\) for 'pic001'.*does not pad cached rows.*fix:.*cached\.loader\(batch_size, "
        r"seed=0\).*BucketBatchSampler",
    ):
        collate([cached[0], cached[2]])


def test_collate_refuses_foreign_items_and_mixed_caches(path, tmp_path):
    with pytest.raises(CacheError, match=r"not an item of a graphsplit\.CachedDataset"):
        collate([{"latents": torch.zeros(1)}])
    with pytest.raises(ValueError, match="at least one item"):
        collate([])
    other = tmp_path / "other"
    cache(make_split(), loader(Pictures(2)), other, progress=False)
    with pytest.raises(CacheError, match="items of different caches"):
        collate([CachedDataset(path)[0], CachedDataset(other)[0]])


# ------------------------------------------------------------------------------------ staleness


def test_matching_split_is_accepted(path):
    CachedDataset(path, make_split())


def test_changed_frozen_weight_is_refused(path):
    split = make_split()
    with torch.no_grad():
        split.model.encoder.embed.weight[3, 1] += 0.5
    with pytest.raises(StaleCacheError, match=r"(?s)frozen weights differ.*overwrite=True"):
        CachedDataset(path, split)


def test_changed_frozen_buffer_is_refused(path):
    split = make_split()
    split.model.encoder.table[0, 0] = 9.0
    with pytest.raises(StaleCacheError, match="frozen weights differ"):
        CachedDataset(path, split)


def test_changed_step_code_is_refused(path):
    split = make_split()
    encoder = split.model.encoder
    split.stage1 = trace(EncoderWithOtherCode(encoder))
    with pytest.raises(StaleCacheError, match="stage-1 code differs") as caught:
        CachedDataset(path, split)
    assert "weights" not in str(caught.value).split("fix")[0]


class EncoderWithOtherCode(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.conv, self.embed, self.scale = encoder.conv, encoder.embed, encoder.scale
        self.register_buffer("table", encoder.table)

    def forward(self, pixel_values, input_ids):
        latents = self.conv(pixel_values * 0.5)
        text = self.embed(input_ids).transpose(0, 1)
        return {"latents": latents, "text": text, "table": self.table * self.scale}


def test_changed_boundary_is_refused(path):
    split = make_split()
    spec = split.boundary["latents"]
    split.boundary["latents"] = BoundarySpec(
        "latents", spec.shape, torch.float16, 0, spec.bytes_per_sample // 2, spec.source
    )
    with pytest.raises(StaleCacheError, match="boundary differs"):
        CachedDataset(path, split)


def test_other_versions_only_warn(path):
    rewrite_manifest(path, lambda d: d["fingerprint"]["versions"].update(torch="1.0.0"))
    with pytest.warns(UserWarning, match=r"(?s)other library versions.*torch 1.0.0"):
        CachedDataset(path, make_split())


def test_a_split_with_frozen_weights_on_meta_checks_code_and_boundary_only(tmp_path):
    """A stage-2 process never loads the frozen weights; the cache run checked them."""

    def step(on_meta: bool) -> torch.nn.Module:
        with torch.device("meta" if on_meta else "cpu"):
            encoder = torch.nn.Linear(4, 4).requires_grad_(False)
        torch.manual_seed(0)
        return torch.nn.Sequential(encoder, torch.nn.Linear(4, 1))

    import graphsplit

    x = torch.randn(2, 4)
    cache(
        graphsplit.split(step(False), (x,)),
        [{"input": torch.randn(2, 4)}],
        tmp_path,
        progress=False,
    )
    with pytest.warns(UserWarning, match="checked for code and boundary only"):
        dataset = CachedDataset(tmp_path, graphsplit.split(step(True), (x,)))
    assert len(dataset) == 2
    other = torch.nn.Sequential(
        torch.nn.Linear(4, 4, device="meta").requires_grad_(False),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 1),
    )
    with pytest.raises(StaleCacheError, match="stage-1 code differs"):
        CachedDataset(tmp_path, graphsplit.split(other, (x,)))


# -------------------------------------------------------------- verify_inputs and expected keys


def test_changed_sample_image_is_refused(path):
    dataset = Pictures(12)
    CachedDataset(path, make_split(), dataset=dataset)  # unchanged: accepted
    dataset.changed[4] = 1e-3
    with pytest.raises(StaleCacheError, match=r"1 sample\(s\) changed \('pic004'\)"):
        CachedDataset(path, make_split(), dataset=dataset)


def test_added_and_removed_samples_are_named(path):
    with pytest.raises(StaleCacheError, match=r"(?s)2 sample\(s\) are new \('pic012', 'pic013'\)"):
        verify_inputs(path, Pictures(14))
    with pytest.raises(StaleCacheError, match=r"no longer there \('pic010', 'pic011'\)"):
        verify_inputs(CachedDataset(path), Pictures(10))


def test_verify_inputs_hints_at_transforming_collate(path):
    dataset = Pictures(12)
    dataset.changed = dict.fromkeys(range(12), 1.0)
    with pytest.raises(StaleCacheError, match="every sample differs"):
        verify_inputs(path, dataset)


def test_verify_inputs_needs_the_inputs(path):
    class NoIds(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return {"pixel_values": torch.zeros(3, 8, 8)}

    with pytest.raises(CacheError, match=r"item 0 of the dataset lacks \['input_ids'\]"):
        verify_inputs(path, NoIds())


def test_expected_keys_name_missing_and_extra(path):
    keys = [f"pic{i:03d}" for i in range(12)]
    CachedDataset(path, expected_keys=keys)
    with pytest.raises(
        StaleCacheError, match=r"(?s)not in the cache \('new'\).*no longer there \('pic011'\)"
    ):
        CachedDataset(path, expected_keys=[*keys[:-1], "new"])


# ------------------------------------------------------------------------------------- security


class Boom:
    """Unpickling this creates a marker file: the test fails if anything unpickles."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def pickle_bomb(marker: Path) -> bytes:
    bomb = Boom()
    bomb.marker = marker
    return pickle.dumps(bomb)


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("graphsplit must never unpickle cache files")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_pickle_files_in_the_folder_are_never_loaded(path, tmp_path, no_unpickling):
    marker = tmp_path / "executed"
    (path / "evil.pkl").write_bytes(pickle_bomb(marker))
    (path / "shard-00099.pt").write_bytes(pickle_bomb(marker))
    cached = CachedDataset(path)
    [cached[i] for i in range(len(cached))]
    assert check_cache(path).ok
    assert not marker.exists()


def test_a_pickle_in_place_of_a_shard_is_refused(path, tmp_path, no_unpickling):
    marker = tmp_path / "executed"
    shard = path / "shard-00001.safetensors"
    payload = pickle_bomb(marker)
    shard.write_bytes(payload)
    with pytest.raises(CorruptCacheError, match="shard-00001"):
        CachedDataset(path)[2]
    rewrite_manifest(
        path, lambda d: d["shards"][1].update(checksum=checksum_file(shard), bytes=len(payload))
    )
    with pytest.raises(CorruptCacheError, match=r"header"):
        CachedDataset(path)[2]
    assert not marker.exists()
