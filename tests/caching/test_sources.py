"""Where batches come from: loaders, plain iterables, keys, and the loaders cache() refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CacheError
from tests.caching.fixtures import SMALL, Pictures, cache_contents, loader, stage1_rows

# ----------------------------------------------------------------------------- batches and keys


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


# ------------------------------------------------------------------------------------- refusals


def test_shuffled_loader_is_refused(split, tmp_path):
    with pytest.raises(CacheError, match=r"(?s)shuffles.*RandomSampler.*shuffle=False"):
        cache(split, loader(shuffle=True), tmp_path)


def test_prepared_loader_is_refused(split, tmp_path):
    Prepared = type("DataLoaderShard", (), {"__module__": "accelerate.data_loader"})
    with pytest.raises(CacheError, match="pass the plain DataLoader and the accelerator"):
        cache(split, Prepared(), tmp_path)


def test_batches_lacking_an_input_are_refused(split, tmp_path):
    batches = [{"pixel_values": b["pixel_values"], "key": b["key"]} for b in loader()]
    with pytest.raises(CacheError, match=r"lack \['input_ids'\]"):
        cache(split, batches, tmp_path, progress=False)


def test_batches_of_the_wrong_type_are_refused(split, tmp_path):
    with pytest.raises(CacheError, match="a batch is a Tensor"):  # the step takes two inputs
        cache(split, [torch.zeros(2, 3)], tmp_path, progress=False)


def test_a_one_input_step_takes_each_batch_tensor_as_its_input(tmp_path):
    """``DataLoader(images)`` gives bare tensors: a step of one input takes each whole."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4).requires_grad_(False), nn.Linear(4, 1))
    images = torch.randn(6, 3)
    split = graphsplit.split(lambda x: model(x).mean(), (images[:2],))
    loader = torch.utils.data.DataLoader(images, batch_size=2)
    info = cache(split, loader, tmp_path, progress=False)
    cached = CachedDataset(tmp_path, split)
    assert info.num_samples == len(cached) == 6
    for row in range(6):
        (value,) = (v for k, v in cached[row].items() if k != "key")
        assert torch.equal(value, model[0](images[row : row + 1])[0])


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


def test_batches_of_unknown_size_are_refused(split, tmp_path):
    with pytest.raises(CacheError, match="cannot tell how many samples a batch holds"):
        cache(split, [{"pixel_values": [1.0], "input_ids": 3}], tmp_path, progress=False)
