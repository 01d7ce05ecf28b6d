"""The DiffSynth bytes benchmark: DiffSynth's data_process bytes, graphsplit's or its blocker."""

from __future__ import annotations

import json

import pytest

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    pytest.skip(WHY_NOT, allow_module_level=True)

from benchmarks import bench_diffsynth_bytes

pytestmark = pytest.mark.slow


def test_the_benchmark_measures_what_diffsynth_would_store(tmp_path):
    assert bench_diffsynth_bytes.main(["--quick", "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "diffsynth_bytes.json").read_text())["results"]
    raw_video = 3 * 5 * 32 * 32 * 4  # the (1, 3, 5, 32, 32) float32 clip DiffSynth stores
    assert result["diffsynth_bytes_per_sample"] > raw_video
    # the unmodified step splits, and stage 2 reads only sizes off the video: it is not cached
    assert 0 < result["graphsplit_bytes_per_sample"] < raw_video
    assert "video" not in result["graphsplit_detail"]
    markdown = (tmp_path / "diffsynth_bytes.md").read_text()
    assert "| Wan 2.1 T2V LoRA" in markdown
