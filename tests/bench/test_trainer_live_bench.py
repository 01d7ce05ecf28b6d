"""Smoke test of the Trainer live-first-epoch benchmark: structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import bench_trainer_live


def test_quick_run_reports_the_live_over_plain_ratio_on_both_clocks(tmp_path):
    assert bench_trainer_live.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "trainer_live.json").read_text())
    assert payload["environment"]["torch_threads"] == 1  # single-threaded by default
    (result,) = payload["results"]
    assert (result["samples"], result["student"], result["rounds"]) == (8, 16, 2)
    for clock in ("wall", "cpu"):
        timed = result["timings"][clock]
        assert set(timed) == {"plain", "live"}
        assert all(len(variant["seconds"]) == 2 for variant in timed.values())
        ratio = result[clock]["live_over_plain"]
        live, plain = timed["live"]["seconds"], timed["plain"]["seconds"]
        assert ratio["median"] == pytest.approx(sum(a / b for a, b in zip(live, plain)) / 2)
    markdown = (tmp_path / "trainer_live.md").read_text()
    assert "| 16 / 32 | 8 (4) | wall |" in markdown and "| 16 / 32 | 8 (4) | cpu |" in markdown
