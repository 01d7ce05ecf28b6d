"""benchmarks/bench_signatures.py runs (--quick: the size-branch case, one round) and reports
what a new shape costs against the first split on both clocks, and the bytes per
sample of one mixed cache against a cache per shape."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_signatures


def test_quick_run_reports_the_plan_ratio_and_the_bytes_per_sample(tmp_path):
    assert bench_signatures.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "signatures.json").read_text())
    (row,) = payload["results"]
    assert row["case"] == "branch" and row["shapes"] == [16, 24]
    assert set(row["new_over_first"]) == {"wall", "cpu"}
    assert row["plans_made_for_the_new_shape"] == 1  # the size branch: a plan of its own
    assert row["new_over_first"]["wall"]["median"] > 0
    assert row["samples"] == 4 and row["bytes_per_sample"]["one_mixed_cache"] > 0
    markdown = (tmp_path / "signatures.md").read_text()
    assert "new / first (wall)" in markdown and "| branch | 16 vs 24 |" in markdown


def test_baseline_run_times_the_first_and_a_later_split_in_fresh_children(tmp_path):
    checkout = Path(__file__).resolve().parents[2]  # its own graphsplit as the baseline
    argv = ["--cases", "branch", "--baseline", str(checkout), "--rounds", "1"]
    assert bench_signatures.main([*argv, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "signatures_first_split.json").read_text())
    (row,) = payload["results"]
    assert row["case"] == "branch" and row["same_plan"] is True
    for split in ("first", "again"):
        assert row[split]["current_s"]["median"] > 0 and row[split]["cpu_ratio"]["median"] > 0
    assert "| branch | yes |" in (tmp_path / "signatures_first_split.md").read_text()
