"""benchmarks/bench_stage1_state.py runs (--quick) and reports stage 1 with the module state
put back against stage 1 without, and the snapshot's cost on a step built on meta."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_stage1_state


def test_quick_run_reports_the_ratio_and_the_snapshot(tmp_path):
    assert bench_stage1_state.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "stage1_state.json").read_text())
    assert payload["benchmark"] == "stage1_state"
    result = payload["results"]
    for clock in ("wall", "cpu"):
        assert result["stage1"]["ratio"][clock]["median"] > 0
    (row,) = result["snapshot"]
    assert row["case"] == "tiny" and row["modules"] > 0 and row["cpu_s_median"] >= 0
    markdown = (tmp_path / "stage1_state.md").read_text()
    assert "stage 1 with / without the snapshot" in markdown


def test_the_snapshot_is_put_back_after_timing_without_it():
    from graphsplit.calls import stages

    kept = stages.ModuleState
    with bench_stage1_state._without_snapshot():
        assert stages.ModuleState is bench_stage1_state._TakesNothing
    assert stages.ModuleState is kept
