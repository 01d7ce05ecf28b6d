"""The file checksums: xxh3 written, crc32 and sha256 still read, a missing xxhash explained."""

from __future__ import annotations

import hashlib
import zlib

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from graphsplit.caching.format import checksums
from graphsplit.caching.store import regular_files
from graphsplit.errors import CacheError


@given(st.lists(st.binary(max_size=300), max_size=6))
def test_running_checksum_equals_the_checksum_of_the_joined_bytes(pieces):
    whole = b"".join(pieces)
    for algorithm, expected in [
        ("xxh3", f"xxh3:{xxhash.xxh3_64_hexdigest(whole)}"),
        ("crc32", f"crc32:{zlib.crc32(whole):08x}"),
        ("sha256", f"sha256:{hashlib.sha256(whole).hexdigest()}"),
    ]:
        running = checksums.Running(algorithm)
        for piece in pieces:
            running.update(memoryview(piece))
        assert running.checksum() == expected == checksums.of_buffer(whole, algorithm)
        assert checksums.CHECKSUM.fullmatch(expected)
        assert checksums.algorithm_of(expected) == algorithm


def test_new_files_get_xxh3_and_older_checksums_still_verify(tmp_path):
    assert checksums.ALGORITHM == "xxh3"
    path = tmp_path / "shard.bin"
    path.write_bytes(b"rows of a shard")
    recorded = [regular_files.checksum_file(path, algorithm) for algorithm in checksums.ALGORITHMS]
    assert [checksums.algorithm_of(checksum) for checksum in recorded] == list(checksums.ALGORITHMS)
    assert all(
        regular_files.file_matches(path, size=15, checksum=checksum) for checksum in recorded
    )
    path.write_bytes(b"rows of a shard"[:-1] + b"?")  # one byte changed, same size
    assert not any(
        regular_files.file_matches(path, size=15, checksum=checksum) for checksum in recorded
    )


def test_an_xxh3_cache_without_xxhash_asks_for_the_package(monkeypatch):
    monkeypatch.setattr(checksums, "xxhash", None)
    with pytest.raises(CacheError, match=r"xxh3 checksums.*\n  fix:    pip install xxhash"):
        checksums.Running("xxh3")
    assert checksums.of_buffer(b"x", "crc32") == f"crc32:{zlib.crc32(b'x'):08x}"


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        checksums.Running("md5")
