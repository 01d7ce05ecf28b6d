"""A cache exported to Hugging Face ``datasets`` and read back: bit-exact rows, the fingerprint
kept (in memory, through parquet, save_to_disk and streaming), and stage 2 trained from the
re-imported dataset giving the same losses and gradients as from the folder."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store.record_files import read_manifest
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import ManifestError, StaleCacheError
from tests.caching.fixtures import SMALL, Model, Pictures, bucket_batches, loader, make_split

datasets = pytest.importorskip(
    "datasets", reason="the optional `datasets` package is not installed (graphsplit[datasets])"
)
from graphsplit.caching.read.hf_export import (  # noqa: E402 (after the skip)
    HFCachedDataset,
    HFCachedIterable,
    HFExportError,
    export_record,
    to_hf_dataset,
)


def _bits(value: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    """dtype, shape and the raw bytes: equal means bit for bit (NaN payloads, -0.0 too)."""
    return (
        value.dtype,
        tuple(value.shape),
        value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(),
    )


def _same_items(left, right) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert a.keys() == b.keys()
        assert a["key"] == b["key"]
        for name in a:
            if name != "key":
                assert _bits(a[name]) == _bits(b[name]), (a["key"], name)
        assert a.dim_orders == b.dim_orders


def _train(split, batches, steps: int = 3) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """A few SGD steps of a copy of stage 2; each step's loss and gradients."""
    head = copy.deepcopy(split.stage2)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    seen = []
    torch.manual_seed(0)
    for batch in batches[:steps]:
        optimizer.zero_grad()
        loss = head(**batch)
        loss.backward()
        seen.append((loss.detach().clone(), [p.grad.clone() for p in head.parameters()]))
        optimizer.step()
    return seen


def test_round_trip_is_bit_exact_and_keeps_the_fingerprint(built):
    folder = CachedDataset(built)
    exported = to_hf_dataset(built)
    # text has its batch dim second: its rows carry a memory order, kept in a column
    assert exported.column_names == ["key", "latents", "text", "_graphsplit_dim_orders"]
    assert any(order is not None for order in folder[0].dim_orders)
    assert exported.features["text"] == datasets.List(datasets.List(datasets.Value("float32")))
    back = HFCachedDataset(exported, make_split())
    assert back.header.fingerprint == read_manifest(built).header.fingerprint
    assert back.keys == folder.keys
    _same_items(list(folder), list(back))
    assert {k: _bits(v) for k, v in back.constants.items()} == {
        k: _bits(v) for k, v in folder.constants.items()
    }
    assert "fingerprint" in exported.info.description


def test_stage2_trained_from_the_reimported_dataset_matches_the_folder(built):
    split = make_split()
    folder = CachedDataset(built, split)
    back = HFCachedDataset(to_hf_dataset(built), split)
    batches = {
        name: [collate([data[i] for i in range(j, j + 3)]) for j in range(0, 12, 3)]
        for name, data in (("folder", folder), ("datasets", back))
    }
    from_folder = _train(split, batches["folder"])
    from_datasets = _train(split, batches["datasets"])
    assert len(from_folder) == 3
    for (loss_a, grads_a), (loss_b, grads_b) in zip(from_folder, from_datasets):
        assert _bits(loss_a) == _bits(loss_b)
        assert [_bits(g) for g in grads_a] == [_bits(g) for g in grads_b]


def test_the_fingerprint_survives_parquet_save_to_disk_and_streaming(built, tmp_path):
    exported = to_hf_dataset(built)
    fingerprint = read_manifest(built).header.fingerprint
    exported.to_parquet(str(tmp_path / "cache.parquet"))
    from_parquet = datasets.load_dataset(
        "parquet",
        data_files=str(tmp_path / "cache.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf"),
    )
    exported.save_to_disk(str(tmp_path / "saved"))
    saved = datasets.load_from_disk(str(tmp_path / "saved"))
    streamed = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "cache.parquet"), split="train", streaming=True
    )
    folder = list(CachedDataset(built))
    for dataset in (from_parquet, saved):
        assert export_record(dataset).header.fingerprint == fingerprint
        _same_items(folder, list(HFCachedDataset(dataset, make_split())))
    iterable = HFCachedIterable(streamed, make_split())
    assert iterable.header.fingerprint == fingerprint
    _same_items(folder, list(iterable))


def test_a_large_export_streams_into_the_folder_named(built, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "not-here"))
    exported = to_hf_dataset(built, cache_dir=tmp_path / "arrow")
    assert exported.cache_files and all(
        str(tmp_path / "arrow") in entry["filename"] for entry in exported.cache_files
    )
    assert not (tmp_path / "not-here").exists()
    _same_items(list(CachedDataset(built)), list(HFCachedDataset(exported, make_split())))
    assert export_record(exported).header == read_manifest(built).header


def test_bfloat16_storage_and_buckets_round_trip(tmp_path):
    split = make_split()
    pictures = Pictures(8, sizes=(8, 4))
    batches = bucket_batches(pictures, 2)
    cache(
        split,
        loader(pictures, batch_sampler=batches, batch_size=1),
        tmp_path / "c",
        shard_bytes=SMALL,
        storage_dtype=torch.bfloat16,
        progress=False,
    )
    folder = CachedDataset(tmp_path / "c", split)
    exported = to_hf_dataset(tmp_path / "c", split)
    back = HFCachedDataset(exported, split)
    assert back[0]["latents"].dtype == torch.bfloat16
    assert {tuple(item["latents"].shape) for item in back} == {(4, 4, 4), (4, 2, 2)}
    _same_items(list(folder), list(back))
    assert dict(back.max_abs_error) == dict(folder.max_abs_error)
    assert back.max_abs_error  # the storage error is recorded, and kept


def test_a_dataset_from_another_split_is_refused(built):
    exported = to_hf_dataset(built)
    other = make_split(Model(seed=5))
    with pytest.raises(StaleCacheError, match="was not made by this split") as caught:
        HFCachedDataset(exported, other)
    assert "overwrite=True" in str(caught.value)
    with pytest.raises(StaleCacheError, match="was not made by this split"):
        to_hf_dataset(built, other)


def test_a_dataset_without_the_record_is_refused_with_the_fix(built):
    plain = datasets.Dataset.from_dict({"key": ["a"], "latents": [[1.0]]})
    with pytest.raises(ManifestError, match="carries no graphsplit export record") as caught:
        HFCachedDataset(plain)
    assert "fix:" in str(caught.value) and "to_hf_dataset" in str(caught.value)
    exported = to_hf_dataset(built)
    with pytest.raises(ManifestError, match=r"lacks the column\(s\) \['text'\]") as caught:
        HFCachedDataset(exported.remove_columns(["text"]))
    assert "keep every column" in str(caught.value)


def test_a_damaged_record_is_refused_naming_the_field(built):
    exported = to_hf_dataset(built)
    features = exported.features.copy()
    record = features["key"].id
    features["key"] = datasets.Value("string", id=record.replace('"batch_dim"', '"batch_dims"'))
    damaged = exported.cast(features)
    with pytest.raises(ManifestError, match="header") as caught:
        HFCachedDataset(damaged)
    assert "fix:" in str(caught.value)


def test_without_datasets_the_error_names_the_extra(built, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(HFExportError, match=r"graphsplit\[datasets\]") as caught:
        to_hf_dataset(built)
    assert "pip install" in str(caught.value)
