"""Smoke test of the cache-bytes benchmark: structure of its output, and its arithmetic."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_cache_bytes


def test_cache_bytes_benchmark_compares_three_plans(tmp_path):
    assert bench_cache_bytes.main(["--cases", "tiny", "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "cache_bytes.json").read_text())
    plans = result["bytes_per_sample"]
    # tiny zoo step: latents (8, 16, 16) float32 as mean+log-variance, text (16, 32) float32
    assert plans["graphsplit"] == 8 * 16 * 16 * 4 + 16 * 32 * 4
    assert plans["one_vae_sample"] == 4 * 16 * 16 * 4 + 16 * 32 * 4
    assert plans["every_frozen_output"] >= plans["graphsplit"]  # adds the unused pooled output
    assert "| tiny |" in (tmp_path / "cache_bytes.md").read_text()
