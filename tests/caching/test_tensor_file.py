"""The safetensors format as graphsplit writes it and reads remote shards by ranges."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load

from graphsplit.caching.tensor_file import layout, serialise


def _parts(tensors, metadata):
    pieces, total = serialise(tensors, metadata)
    data = b"".join(bytes(piece) for piece in pieces)
    (length,) = struct.unpack("<Q", data[:8])
    return data, json.loads(data[8 : 8 + length]), 8 + length, total


def test_serialised_bytes_are_what_safetensors_reads_and_layout_places_each_tensor():
    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.tensor([1, 2], dtype=torch.int8)}
    data, header, base, total = _parts(tensors, {"graphsplit_keys": '["k"]'})
    assert len(data) == total and base % 8 == 0
    assert {name: value.tolist() for name, value in load(data).items()} == {
        name: value.tolist() for name, value in tensors.items()
    }
    places = layout(header, base, total)
    for name, value in tensors.items():
        place = places[name]
        raw = bytearray(data[place.start : place.end])
        assert torch.equal(torch.frombuffer(raw, dtype=place.dtype).reshape(place.shape), value)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda entry: entry.update(data_offsets=[24, 48]), "lies outside the file"),
        (lambda entry: entry.update(shape=[5, 3]), "not what (5, 3) needs"),
        (lambda entry: entry.update(dtype="X99"), "is malformed"),
        (lambda entry: entry.pop("shape"), "is malformed"),
    ],
)
def test_a_lying_header_is_a_problem_not_a_read_outside_the_file(change, problem):
    _, header, base, total = _parts({"b": torch.zeros(2, 3)}, {})
    change(header["b"])
    assert problem in layout(header, base, total)
    assert layout([], base, total) == "its header is not a JSON object"
