"""Smoke test of the cache I/O benchmark: the structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_cache_io


def test_cache_io_benchmark_writes_json_and_markdown(tmp_path):
    argv = ["--samples", "12", "--batch-size", "4", "--shard-mb", "1", "--rounds", "1"]
    assert bench_cache_io.main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cache_io.json").read_text())
    assert result["samples"] == 12 and result["num_shards"] >= 2
    assert set(result["median_seconds"]) == {
        "write_graphsplit",
        "write_save_file",
        "write_save_file_fsync",
        "read_graphsplit",
        "read_graphsplit_verified",
        "read_safe_open",
    }
    for ratio in ("write_ratio", "write_ratio_vs_fsync", "read_ratio", "read_ratio_verified"):
        assert result[ratio] > 0
    markdown = (tmp_path / "cache_io.md").read_text()
    assert "| write (vs save_file) |" in markdown and "| shuffled read" in markdown


def test_cache_io_benchmark_help(capsys):
    with pytest.raises(SystemExit) as caught:
        bench_cache_io.main(["--help"])
    assert caught.value.code == 0
    assert "--samples" in capsys.readouterr().out
