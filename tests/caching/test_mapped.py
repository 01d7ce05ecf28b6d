"""A shard's rows are views of its memory map (items copy them): the file is never written."""

from __future__ import annotations

import gc
import json
import mmap
import struct
import types

import pytest
import torch
from safetensors import safe_open

from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.format.tensor_places import TensorTable, read_table
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store.mapped import MappedShard
from graphsplit.caching.store.regular_files import checksum_file
from graphsplit.caching.write.cache_run import cache
from tests.caching.fixtures import ChannelsLastEncoder, Pictures, loader, make_split, trace


def test_rows_of_a_shard_are_views_of_one_map_equal_to_safetensors(path):
    cached = CachedDataset(path)
    first, second = cached[0], cached[1]  # shard 0 holds samples 0 and 1
    handle = cached._handles[0]  # the shard's rows are views of one map ...
    storage = handle.get_tensor("0/latents").untyped_storage().data_ptr()
    assert handle.get_tensor("1/latents").untyped_storage().data_ptr() == storage
    assert handle.get_tensor("0/text").untyped_storage().data_ptr() == storage
    # ... and items are copies of them (issue 26: an item changed in place stays apart)
    assert first["latents"].untyped_storage().data_ptr() != storage
    assert second["latents"].untyped_storage().data_ptr() != storage
    shard = cached.manifest.shards[0]
    with safe_open(str(path / shard.file), "pt") as handle:
        for row, item in enumerate((first, second)):
            for name in ("latents", "text"):
                expected = handle.get_tensor(f"{row}/{name}")
                assert item[name].dtype == expected.dtype
                assert torch.equal(item[name].contiguous(), expected.contiguous())


def test_collate_makes_the_only_copy(path):
    cached = CachedDataset(path)
    items = [cached[0], cached[1]]
    batch = collate(items)
    storage = batch["latents"].untyped_storage().data_ptr()
    assert storage != items[0]["latents"].untyped_storage().data_ptr()
    assert torch.equal(batch["latents"][0], items[0]["latents"])


def test_writing_into_an_item_never_changes_the_file(path):
    shard = path / "shard-00000.safetensors"
    before = checksum_file(shard)
    cached = CachedDataset(path)
    original = cached[0]["latents"].clone()
    cached[0]["latents"].add_(1.0)
    assert checksum_file(shard) == before
    assert torch.equal(CachedDataset(path)[0]["latents"], original)


def test_items_outlive_their_dataset_and_its_maps(path):
    cached = CachedDataset(path)
    item = cached[3]
    expected = item["latents"].clone()
    del cached
    gc.collect()
    assert torch.equal(item["latents"], expected)


def _mapped(payload: bytes) -> mmap.mmap:
    mapped = mmap.mmap(-1, len(payload))
    mapped[:] = payload
    return mapped


def _file(header: dict, data: bytes, pad: int) -> bytes:
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


def test_a_misaligned_tensor_is_copied_not_refused():
    values = torch.tensor([1.5, -2.0, 3.25])
    for pad in range(4):  # every alignment of the data start
        data = values.numpy().tobytes()
        header = {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, len(data)]}}
        mapped = _mapped(_file(header, data, pad))
        table = _table(mapped)
        assert isinstance(table, TensorTable)
        assert torch.equal(MappedShard(mapped, table).get_tensor("x"), values)


def _table(mapped):
    return read_table(lambda start, end: mapped[start:end], len(mapped))


def test_a_tensor_outside_the_file_is_a_problem():
    header = {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    problem = _table(_mapped(_file(header, b"\x00" * 8, 0)))
    assert str(problem) == "its tensors end at byte 86, past the file's end"


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_collate_widens_stored_rows_in_the_one_copy(tmp_path, layout):
    """bfloat16 rows become a float32 batch by one stack into a float32 tensor, bit-equal to
    stacking then casting, with stage 1's strides."""
    split = make_split()
    if layout == "channels_last":  # rows stored in memory order, batched back to it
        latents = BoundarySpec("latents", (2, 4, 8, 8), torch.float32, 0, 1024, "x")
        split = types.SimpleNamespace(
            stage1=trace(ChannelsLastEncoder()),
            boundary={"latents": latents},
            input_names=("pixel_values",),
        )
    cache(split, loader(Pictures(6)), tmp_path, storage_dtype=torch.bfloat16, progress=False)
    cached = CachedDataset(tmp_path)
    items = [cached[0], cached[1]]
    rows = [item["latents"] for item in items]
    assert rows[0].dtype == torch.bfloat16
    batch = collate(items)["latents"]
    expected = torch.stack([row.contiguous() for row in rows]).to(torch.float32)
    assert batch.dtype == torch.float32 and torch.equal(batch, expected)
    pictures = Pictures(6)
    computed = split.stage1(
        *[torch.stack([pictures[i][name] for i in (0, 1)]) for name in split.input_names]
    )
    assert batch.stride() == computed["latents"].stride()
