"""Smoke test of the DPO reference benchmark: the structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")

from benchmarks import bench_dpo_reference


def test_quick_run_reports_time_bytes_and_exactness_of_every_variant(tmp_path):
    assert bench_dpo_reference.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "dpo_reference.json").read_text())
    assert payload["benchmark"] == "dpo_reference" and payload["environment"]["torch_threads"] == 1
    result = payload["results"]
    for clock in ("wall", "cpu"):
        assert set(result["timings"][clock]) == set(bench_dpo_reference.VARIANTS)
        assert result["vs_trl_batch_4"][clock]["trl_batch_4"]["median"] == pytest.approx(1.0)
    sizes = result["bytes_per_pair"]
    assert set(sizes) == {"graphsplit", "trl_batch_4", "trl_batch_1"}
    assert all(size > 0 for size in sizes.values())
    # each pair alone, as TRL at precompute_ref_batch_size=1: the same values bit for bit
    assert result["max_abs_difference_from_graphsplit"]["trl_batch_1"] == 0.0
    assert "| graphsplit_again |" in (tmp_path / "dpo_reference.md").read_text()
