"""benchmarks/bench_row_pairing.py runs (--quick: one round, the kd case) and reports the cost
of finding paired rows against the split."""

from __future__ import annotations

import json

from benchmarks import bench_row_pairing


def test_quick_run_reports_the_pairing_cost_against_the_split(tmp_path):
    assert bench_row_pairing.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "row_pairing.json").read_text())
    assert payload["benchmark"] == "row_pairing"
    (result,) = payload["results"]
    assert result["case"] == "kd" and result["paired_rows"] is None
    for clock in ("wall", "cpu"):
        assert result["with_over_split"][clock]["median"] > 0
    assert "| kd |" in (tmp_path / "row_pairing.md").read_text()
