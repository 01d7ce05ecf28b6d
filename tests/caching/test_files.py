"""Crash-safe file writing: atomic writes, commits with checksums, leftovers, a full disk."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
import torch
import xxhash
from safetensors import safe_open

from graphsplit.caching.store import file_writes, regular_files
from graphsplit.errors import CacheError, DiskFullError


def test_write_atomically_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old")
    file_writes.write_atomically(path, b"new")
    assert path.read_bytes() == b"new"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["record.json"]


def test_commit_file_renames_and_reports_size_and_checksum(tmp_path):
    temporary = file_writes.temporary_path(tmp_path / "shard.bin")
    assert temporary.name == f".graphsplit-shard.bin.{os.getpid()}-{file_writes._TOKEN}.tmp"
    assert temporary == file_writes.temporary_path(tmp_path / "shard.bin")  # one per process
    temporary.write_bytes(b"rows")
    size, sha = file_writes.commit_file(temporary, tmp_path / "shard.bin")
    assert (size, sha) == (4, f"xxh3:{xxhash.xxh3_64_hexdigest(b'rows')}")
    assert not temporary.exists()
    assert regular_files.file_matches(tmp_path / "shard.bin", size=4, checksum=sha)
    assert not regular_files.file_matches(tmp_path / "shard.bin", size=5, checksum=sha)
    assert not regular_files.file_matches(tmp_path / "missing.bin", size=4, checksum=sha)
    old = "sha256:" + hashlib.sha256(b"rows").hexdigest()  # as format-1 caches recorded it
    assert regular_files.file_matches(tmp_path / "shard.bin", size=4, checksum=old)
    assert not regular_files.file_matches(tmp_path / "shard.bin", size=4, checksum=old[:-1] + "0")


def test_remove_temporary_files_removes_only_graphsplits_own(tmp_path):
    theirs = [
        ".env.tmp",
        ".notes.tmp",
        ".shard-00001.safetensors.tmp",  # another tool may name its files so: not unmistakable
        ".manifest.json.tmp",
        ".graphsplit-x.tmp",  # no process suffix
        "notes.tmp",
        "shard-00000.safetensors",
    ]
    for name in theirs:
        (tmp_path / name).write_text("x")
    ours = file_writes.temporary_path(tmp_path / "shard-00001.safetensors")
    ours.write_text("x")
    (tmp_path / ".graphsplit-manifest.json.999999-0123456789abcdef.tmp").write_text("x")
    file_writes.remove_temporary_files(tmp_path, tmp_path / "absent")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == sorted(theirs)


def test_no_room_becomes_a_disk_full_error_saying_what_was_needed(tmp_path):
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        full = pytest.raises(
            DiskFullError, match=r"(?s)no room to write shard-00003.*needs 2\.0 KiB.*resumes"
        )
        with full, file_writes.no_room(tmp_path, "shard-00003.safetensors", 2048):
            raise OSError(code, os.strerror(code))
    with (
        pytest.raises(PermissionError),
        file_writes.no_room(tmp_path, "shard-00003.safetensors", 1),
    ):
        raise PermissionError(errno.EACCES, "denied")


def test_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(descriptor, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(file_writes, "_write_all", full)
    with pytest.raises(DiskFullError, match=r"record\.json"):
        file_writes.write_atomically(tmp_path / "record.json", b"{}")
    with pytest.raises(DiskFullError, match=r"shard\.safetensors.*needs 4\.1 KiB"):
        file_writes.save_tensors({"x": torch.zeros(1024)}, tmp_path / "shard.safetensors", {})
    assert list(tmp_path.iterdir()) == []


def test_save_tensors_writes_what_safetensors_reads(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "b/view": base[1],  # a view of a shared storage
        "a/half": base[2].to(torch.bfloat16),
        "c/flags": torch.tensor([True, False]),
        "d/scalar": torch.tensor(7, dtype=torch.int64),
        "e/empty": torch.zeros(0, 3),
    }
    path = tmp_path / "shard.safetensors"
    computed = file_writes.save_tensors(tensors, path, {"graphsplit_keys": '["a"]'})
    size, sha = file_writes.commit_file(file_writes.temporary_path(path), path, checksum=computed)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"graphsplit_keys": '["a"]'}
        assert sorted(handle.keys()) == sorted(tensors)
        for name, value in tensors.items():
            assert torch.equal(handle.get_tensor(name), value)
    assert size == path.stat().st_size and sha == computed == regular_files.checksum_file(path)
    assert sha == f"xxh3:{xxhash.xxh3_64_hexdigest(path.read_bytes())}"  # from memory, as on disk


def test_a_dtype_safetensors_lacks_is_named(tmp_path):
    with pytest.raises(CacheError, match=r"(?s)'rows' is torch.complex128.*cast it"):
        file_writes.save_tensors(
            {"rows": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "s", {}
        )


def test_save_tensors_writes_each_large_piece_alone_cut_and_gathers_small_ones(
    tmp_path, monkeypatch
):
    """Large writes at aligned offsets let the page cache allocate large folios, which cost
    several times the CPU time in a VM (see ``file_writes._writes``): a tensor of 64 KiB or more is
    written by calls of its own, at most 256 KiB each; smaller pieces (the header, small
    tensors) share calls of under 64 KiB. The file is still whole and hashed as written."""
    calls: list[list[int]] = []
    write_all = file_writes._write_all

    def counting(descriptor, data):
        calls.append([memoryview(piece).nbytes for piece in data])
        write_all(descriptor, data)

    monkeypatch.setattr(file_writes, "_write_all", counting)
    tensors = {
        "big": torch.randn(300_000),  # 1.2 MB: five calls, the last one shorter
        "mid": torch.zeros(20_000, dtype=torch.float64),  # 160 KB: one call
        "small": torch.arange(5),
        "after": torch.ones(3, 7),
        "many": torch.zeros(10_000, dtype=torch.int16),  # 20 KB
    }
    path = tmp_path / "shard.safetensors"
    computed = file_writes.save_tensors(tensors, path, {})
    file_writes.commit_file(file_writes.temporary_path(path), path, checksum=computed)
    sizes = [sum(call) for call in calls]
    assert sum(sizes) == path.stat().st_size
    # Written widest dtype first, then by name: mid, small, after, big, many.
    assert calls[0] == [sizes[0]] and sizes[0] < 1000  # the header, alone before a large piece
    assert calls[1] == [160_000]
    assert calls[2] == [5 * 8, 3 * 7 * 4]  # small pieces gathered into one call
    assert sizes[3:8] == [256 << 10] * 4 + [1_200_000 - 4 * (256 << 10)]
    assert calls[8] == [20_000]
    assert len(calls) == 9 and max(sizes) == 256 << 10
    assert computed == f"xxh3:{xxhash.xxh3_64_hexdigest(path.read_bytes())}"
    with safe_open(str(path), framework="pt") as handle:
        assert all(torch.equal(handle.get_tensor(name), value) for name, value in tensors.items())
