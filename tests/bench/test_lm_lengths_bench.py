"""benchmarks/bench_lm_lengths.py runs (--quick: one child, a one-layer LoRA Llama, OPT or
BART) and reports the plans made over eight padded lengths and the planning time of caching
them."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_lm_lengths


@pytest.mark.parametrize("arch", bench_lm_lengths.ARCHS)
def test_quick_run_reports_plans_and_seconds(tmp_path, arch):
    assert bench_lm_lengths.main(["--quick", "--arch", arch, "--out", str(tmp_path)]) == 0
    name = "lm_lengths" if arch == "llama" else f"lm_lengths_{arch}"
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    row = payload["results"]["versions"]["current"]
    assert row["path"] == ["trace"]
    assert len(row["plans"]) == 1 and 1 <= row["plans"][0] <= 8
    assert row["cpu"]["median"] > row["stage1_cpu"]["median"] > 0
    markdown = (tmp_path / f"{name}.md").read_text()
    assert "| current |" in markdown and "plans for 8 lengths" in markdown
    assert f"LoRA {arch}" in markdown
