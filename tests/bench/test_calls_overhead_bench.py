"""benchmarks/bench_calls_overhead.py runs (--quick: every case, one round) and reports stage
2's time against the step written by hand, stage 1 against the traced path and the bytes per
sample of both paths; the losses of the three stage-2 variants agree before any timing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_calls_overhead


def test_quick_run_reports_overheads_and_bytes_for_sd_and_kd(tmp_path):
    assert bench_calls_overhead.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "calls_overhead.json").read_text())
    assert payload["benchmark"] == "calls_overhead"
    rows = {row["case"]: row for row in payload["results"]}
    assert set(rows) == {"sd", "kd", "kd-wide"}
    for name, row in rows.items():
        want = {"calls": True, "traced": True} | (
            {"free": True, "user's": True} if "kd" in name else {}
        )
        assert row["losses_agree_with_hand"] == want
        for figure in ("calls_over_hand", "traced_over_hand", "stage1_calls_over_traced"):
            assert set(row[figure]) == {"wall", "cpu"}
            assert row[figure]["cpu"]["count"] == 1 and row[figure]["cpu"]["median"] > 0
        assert row["samples"] > 0
        assert row["bytes_per_sample"]["calls"] > 0 and row["bytes_per_sample"]["traced"] > 0
    assert "teacher__0__logits" in rows["kd"]["calls_keys"]
    for figure in ("free_call_over_hand", "calls_over_free_call"):
        assert rows["kd-wide"][figure]["cpu"]["median"] > 0 and figure not in rows["sd"]
    assert "vae_quant_conv__0__out" in rows["sd"]["calls_keys"]
    markdown = (tmp_path / "calls_overhead.md").read_text()
    assert "calls stage 2 / by hand (CPU)" in markdown and "| sd (tiny) |" in markdown
    assert "free call / by hand (CPU)" in markdown and "| kd-wide (tiny) |" in markdown
