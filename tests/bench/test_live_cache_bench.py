"""Smoke test of the cache-while-training benchmark: structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_live_cache


def test_quick_run_reports_the_live_over_plain_ratio_on_both_clocks(tmp_path):
    assert bench_live_cache.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "live_cache.json").read_text())
    assert payload["environment"]["torch_threads"] == 1  # single-threaded by default
    (result,) = payload["results"]
    assert (result["size"], result["samples"], result["rounds"]) == ("tiny", 4, 2)
    for clock in ("wall", "cpu"):
        timed = result["timings"][clock]
        assert set(timed) == {"plain", "live"}
        assert all(len(variant["seconds"]) == 2 for variant in timed.values())
        ratio = result[clock]["live_over_plain"]
        # The median of the same-round ratios, not a ratio of medians.
        live, plain = timed["live"]["seconds"], timed["plain"]["seconds"]
        assert ratio["median"] == pytest.approx(sum(a / b for a, b in zip(live, plain)) / 2)
    markdown = (tmp_path / "live_cache.md").read_text()
    assert "| tiny | 4 (2 × 32) | wall |" in markdown and "| tiny | 4 (2 × 32) | cpu |" in markdown
