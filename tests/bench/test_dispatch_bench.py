"""benchmarks/bench_dispatch.py runs (--quick: one round) and reports stage 2's per-batch
dispatch for each case as a share of the stage-2 step."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_dispatch


def test_quick_run_reports_each_dispatch_case_against_the_step(tmp_path):
    assert bench_dispatch.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "dispatch.json").read_text())
    assert payload["benchmark"] == "dispatch"
    result = payload["results"]
    for clock in ("wall", "cpu"):
        assert set(result["dispatch_over_step"][clock]) == set(bench_dispatch.CASES)
        for figures in result["dispatch_over_step"][clock].values():
            assert figures["median"] > 0
    markdown = (tmp_path / "dispatch.md").read_text()
    assert all(f"| {case} |" in markdown for case in bench_dispatch.CASES)


def test_the_stub_forward_is_put_back():
    class Stage:
        def forward(self):
            return "generated"

    stage = Stage()
    with bench_dispatch._forward_returns_at_once(stage):
        assert stage.forward() is None
    assert stage.forward() == "generated"


def test_meta_check_option_times_the_hook_and_the_walk_it_replaced(tmp_path):
    assert bench_dispatch.main(["--quick", "--meta-check", "--out", str(tmp_path)]) == 0
    check = json.loads((tmp_path / "dispatch.json").read_text())["results"]["meta_check"]
    assert check["tensors"] > 900 and check["modules"] > 1900  # SD 1.5's structure with LoRA
    assert set(check["seconds_per_call"]) == {"gathered dicts", "walk"}
    assert all(value["median"] > 0 for value in check["seconds_per_call"].values())
    assert "| walk |" in (tmp_path / "dispatch.md").read_text()
