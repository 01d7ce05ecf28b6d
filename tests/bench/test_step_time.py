"""Smoke test of the step-time benchmark: structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_step_time


def test_step_time_benchmark_writes_json_and_markdown(tmp_path):
    assert bench_step_time.main(["--sizes", "tiny", "--rounds", "1", "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "step_time.json").read_text())
    assert set(result["median_seconds"]) == {"unsplit", "graphsplit_stage2", "hand_written"}
    assert all(value > 0 for value in result["median_seconds"].values())
    assert {"stage2_over_hand_written", "ideal_speedup", "fraction_of_ideal"} <= set(result)
    assert "| tiny | 2 × 32 |" in (tmp_path / "step_time.md").read_text()
