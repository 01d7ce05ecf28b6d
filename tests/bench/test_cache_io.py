"""Smoke test of the cache I/O benchmark: the structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_cache_io


def test_quick_run_reports_same_round_ratios_on_both_clocks(tmp_path):
    assert bench_cache_io.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "cache_io.json").read_text())
    assert payload["benchmark"] == "cache_io" and payload["environment"]["torch_threads"] == 1
    result = payload["results"]
    assert result["samples"] == 12 and result["num_shards"] >= 2 and result["rounds"] == 1
    for clock in ("wall", "cpu"):
        assert set(result["timings"][clock]) == set(bench_cache_io.VARIANTS)
        for key, (baseline, ours) in bench_cache_io.RATIOS.items():
            seconds = result["timings"][clock]
            (expected,) = (
                b / o for b, o in zip(seconds[baseline]["seconds"], seconds[ours]["seconds"])
            )
            assert result[clock][key]["median"] == pytest.approx(expected) and expected > 0
    large = result["large"]  # the realistic size, here shrunk to 8 MiB in 4 MiB shards
    assert large["samples"] == 28 and large["num_shards"] >= 2 and large["rounds"] == 1
    assert set(large["wall"]) == set(result["wall"]) and large["cpu"]["write_ratio"]["median"] > 0
    markdown = (tmp_path / "cache_io.md").read_text()
    assert markdown.count("| write (vs save_file) |") == 2 and "| shuffled read" in markdown
    assert "28 samples" in markdown


def test_cache_io_benchmark_help(capsys):
    with pytest.raises(SystemExit) as caught:
        bench_cache_io.main(["--help"])
    assert caught.value.code == 0
    text = capsys.readouterr().out
    for option in ("--samples", "--threads", "--rounds", "--quick", "--large-mb"):
        assert option in text
