"""Smoke test of benchmarks/bench_memory.py at tiny size: output structure, not memory."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from benchmarks import bench_memory


def test_tiny_run_writes_json_and_markdown(tmp_path):
    assert bench_memory.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "memory.json").read_text())
    assert report["benchmark"] == "memory"
    (result,) = report["results"]
    assert result["size"] == "tiny" and result["steps"] == 1 and result["torch_threads"] == 1
    assert set(result["max_rss_mib"]) == set(bench_memory.VARIANTS)
    assert all(value > 0 for value in result["max_rss_mib"].values())
    assert set(result["above_baseline_mib"]) == set(bench_memory.VARIANTS) - {"baseline"}
    for key in (
        "stage2_over_hand_written",
        "stage2_over_unsplit",
        "above_baseline_stage2_over_hand_written",
        "above_baseline_stage2_over_unsplit",
    ):
        assert isinstance(result[key], float)
        # The ratio is the median of same-repeat ratios, with its spread beside it.
        ratio = result["ratios"][key]
        assert ratio["median"] == result[key] and ratio["q1"] <= ratio["median"] <= ratio["q3"]
    assert result["repeats"] == 1  # --quick runs each variant once
    readings = result["max_rss_all_mib"]
    assert all(len(readings[variant]["values"]) == 1 for variant in bench_memory.VARIANTS)
    # Stage 2 holds no real frozen weight: its real parameters are the UNet's, as by hand.
    real = result["real_param_mib"]
    assert real["graphsplit_stage2"] == pytest.approx(real["hand_written"])
    assert real["unsplit"] > real["graphsplit_stage2"]
    assert "| tiny | 2 × 32 | 1 |" in (tmp_path / "memory.md").read_text()
