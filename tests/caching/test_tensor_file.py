"""The safetensors format as graphsplit writes it and reads remote shards by ranges."""

from __future__ import annotations

import gc
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from graphsplit.caching.format.strict_header import HeaderProblem, parse_header
from graphsplit.caching.format.tensor_file import SAFETENSORS_DTYPES, rows_of, serialise
from graphsplit.caching.format.tensor_places import check_places, tensors_from_bytes
from graphsplit.caching.store import file_writes


def _parts(tensors, metadata):
    pieces, total = serialise(tensors, metadata)
    data = b"".join(bytes(piece) for piece in pieces)
    (length,) = struct.unpack("<Q", data[:8])
    return data, json.loads(data[8 : 8 + length]), 8 + length, total


def test_serialised_bytes_are_what_safetensors_reads_and_layout_places_each_tensor():
    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.tensor([1, 2], dtype=torch.int8)}
    data, _, base, total = _parts(tensors, {"graphsplit_keys": '["k"]'})
    assert len(data) == total and base % 8 == 0
    assert {name: value.tolist() for name, value in load(data).items()} == {
        name: value.tolist() for name, value in tensors.items()
    }
    places = check_places(parse_header(data[8:base]), total).places
    for name, value in tensors.items():
        place = places[name]
        raw = bytearray(data[place.start : place.end])
        assert torch.equal(torch.frombuffer(raw, dtype=place.dtype).reshape(place.shape), value)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda entry: entry.update(data_offsets=[24, 48]), "leaves a hole"),
        (lambda entry: entry.update(data_offsets=[0, 48]), "not the 24 bytes"),
        (lambda entry: entry.update(shape=[5, 3]), "not the 60 bytes its F32 [5, 3] needs"),
        (lambda entry: entry.update(dtype="X99"), "dtype 'X99', which graphsplit does not"),
        (lambda entry: entry.pop("shape"), "lacks ['shape']"),
    ],
)
def test_a_lying_header_is_a_problem_not_a_read_outside_the_file(change, problem):
    _, header, _, _ = _parts({"b": torch.zeros(2, 3)}, {})
    change(header["b"])
    text = json.dumps(header).encode()
    parsed = parse_header(text)
    size = 8 + len(text) + 24  # the file as written: 24 bytes of data
    found = parsed if isinstance(parsed, HeaderProblem) else check_places(parsed, size)
    assert isinstance(found, HeaderProblem) and problem in str(found), found
    assert str(parse_header(b"[]")) == "its header is a JSON list, not an object"


def test_tensors_from_bytes_reads_what_it_checks_and_refuses_with_a_graphsplit_error():
    from graphsplit.errors import CorruptCacheError

    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.tensor([1, 2], dtype=torch.int8)}
    data, _, _, _ = _parts(tensors, {"k": "v"})
    read = tensors_from_bytes(data)
    assert set(read) == {"a", "b"} and all(torch.equal(read[n], tensors[n]) for n in tensors)
    with pytest.raises(CorruptCacheError, match=r"(?s)x.safetensors is not a valid.*fix:"):
        tensors_from_bytes(data + b"\x00", source="x.safetensors")


# --------------------------------------------------- files written by hand, read by safetensors


def _random_bytes(shape, dtype, seed):
    """A tensor of ``dtype`` holding random bytes (every bit pattern: NaNs, subnormals, any
    byte in a bool), so only a bit-exact round trip passes."""
    generator = torch.Generator().manual_seed(seed)
    count = 1
    for size in shape:
        count *= size
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2  # safetensors refuses bools that are not 0 or 1
    return raw.view(dtype).reshape(shape)


def _bits(tensor):
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _read_back(tmp_path, tensors):
    path = tmp_path / "shard.safetensors"
    checksum = file_writes.save_tensors(tensors, path, {"graphsplit_keys": '["k"]'})
    file_writes.commit_file(file_writes.temporary_path(path), path, checksum=checksum)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"graphsplit_keys": '["k"]'}
        assert sorted(handle.keys()) == sorted(tensors)
        return {name: handle.get_tensor(name) for name in tensors}


@pytest.mark.parametrize("dtype", list(SAFETENSORS_DTYPES), ids=str)
def test_every_dtype_round_trips_through_safe_open_bit_for_bit(tmp_path, dtype):
    """Whole tensors, 0-dim and empty ones, non-contiguous views (copied to contiguous) and
    rows cut from one batch (slices of its memory), all in one file."""
    batch = _random_bytes((3, 2, 5), dtype, 1)
    tensors = {
        "whole": _random_bytes((4, 3), dtype, 2),
        "scalar": _random_bytes((), dtype, 3),
        "empty": _random_bytes((0, 3), dtype, 4),
        "transposed": _random_bytes((3, 4), dtype, 5).t(),
        "strided": _random_bytes((6, 4), dtype, 6)[::2, 1:],
        **{f"row{number}": row for number, row in enumerate(rows_of(batch))},
        "empty_row": rows_of(_random_bytes((2, 0, 4), dtype, 7))[1],
    }
    expected = {name: value for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    expected.update({f"row{number}": batch[number] for number in range(3)})
    expected["empty_row"] = torch.zeros(0, 4, dtype=dtype)
    read = _read_back(tmp_path, tensors)
    for name, value in expected.items():
        assert read[name].dtype == dtype and read[name].shape == value.shape, name
        assert torch.equal(_bits(read[name]), _bits(value)), name


def test_rows_are_slices_of_the_batch_memory_not_copies():
    batch = torch.arange(12.0).reshape(3, 4)
    rows = rows_of(batch)
    assert [(row.dtype, row.shape, len(row.data)) for row in rows] == [
        (torch.float32, (4,), 16)
    ] * 3
    batch[1, 2] = -1.0
    values = torch.frombuffer(bytearray(rows[1].data), dtype=torch.float32)
    assert values.tolist() == [4.0, 5.0, -1.0, 7.0]


def test_rows_keep_their_batch_memory_alive():
    """The writer drops its batch tensors once their rows are cut; the rows must keep the
    memory they slice (a freed, reused buffer would write other bytes into the shard)."""
    rows = rows_of(torch.arange(4096.0).reshape(4, 1024) * 2)
    gc.collect()
    _ = [torch.full((4, 1024), -7.0) for _ in range(64)]  # reuse whatever was freed
    last = torch.frombuffer(bytearray(rows[3].data), dtype=torch.float32)
    assert torch.equal(last, torch.arange(3072.0, 4096.0) * 2)
