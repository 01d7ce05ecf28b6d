"""Crash-safe file writing: atomic writes, commits with checksums, leftovers, a full disk."""

from __future__ import annotations

import errno
import hashlib

import pytest

from graphsplit.caching import files
from graphsplit.errors import CacheError


def test_write_atomically_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old")
    files.write_atomically(path, b"new")
    assert path.read_bytes() == b"new"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["record.json"]


def test_commit_file_renames_and_reports_size_and_sha256(tmp_path):
    temporary = files.temporary_path(tmp_path / "shard.bin")
    assert temporary.name == ".shard.bin.tmp"
    temporary.write_bytes(b"rows")
    size, sha = files.commit_file(temporary, tmp_path / "shard.bin")
    assert (size, sha) == (4, hashlib.sha256(b"rows").hexdigest())
    assert not temporary.exists()
    assert files.file_matches(tmp_path / "shard.bin", size=4, sha256=sha)
    assert not files.file_matches(tmp_path / "shard.bin", size=5, sha256=sha)
    assert not files.file_matches(tmp_path / "missing.bin", size=4, sha256=sha)


def test_remove_temporary_files_keeps_everything_else(tmp_path):
    for name in (".shard-00001.safetensors.tmp", "shard-00000.safetensors", "notes.tmp"):
        (tmp_path / name).write_text("x")
    files.remove_temporary_files(tmp_path, tmp_path / "absent")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [
        "notes.tmp",
        "shard-00000.safetensors",
    ]


def test_a_full_disk_becomes_a_cache_error_naming_the_file(tmp_path):
    full = pytest.raises(CacheError, match=r"(?s)ran full while writing shard-00003.*rerun")
    with full, files.disk_errors(tmp_path, "shard-00003.safetensors"):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(PermissionError), files.disk_errors(tmp_path, "shard-00003.safetensors"):
        raise PermissionError(errno.EACCES, "denied")
