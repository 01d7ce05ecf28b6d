"""Smoke test of the step-time benchmark: structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_step_time


def test_quick_run_reports_same_round_ratios_on_both_clocks(tmp_path):
    assert bench_step_time.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "step_time.json").read_text())
    assert payload["environment"]["torch_threads"] == 1  # single-threaded by default
    (result,) = payload["results"]
    assert result["size"] == "tiny" and result["rounds"] == 2
    for clock in ("wall", "cpu"):
        timed = result["timings"][clock]
        assert set(timed) == {"unsplit", "graphsplit_stage2", "hand_written"}
        assert all(len(variant["seconds"]) == 2 for variant in timed.values())
        ratio = result[clock]["stage2_over_hand_written"]
        assert ratio["q1"] <= ratio["median"] <= ratio["q3"] and ratio["count"] == 2
        # The reported ratio is the median of the same-round ratios, not a ratio of medians.
        stage2, hand = timed["graphsplit_stage2"]["seconds"], timed["hand_written"]["seconds"]
        assert ratio["median"] == pytest.approx(sum(s / h for s, h in zip(stage2, hand)) / 2)
    markdown = (tmp_path / "step_time.md").read_text()
    assert "| tiny | 2 × 32 | wall |" in markdown and "| tiny | 2 × 32 | cpu |" in markdown
