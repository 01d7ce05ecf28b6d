"""benchmarks/bench_cache_overlap.py runs (--quick: one round) and reports cache() against
stage 1 alone on the same batches, durable and not, with the shards' digest of each run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_cache_overlap


def test_quick_run_reports_cache_against_stage1_and_the_shards_digest(tmp_path):
    assert bench_cache_overlap.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "cache_overlap.json").read_text())
    assert payload["benchmark"] == "cache_overlap"
    result = payload["results"]
    assert set(result["over_stage1"]) == {"cache()", "cache(durable=False)"}
    for figures in result["over_stage1"].values():
        assert set(figures) == {"wall", "cpu"} and figures["cpu"]["median"] > 0
    # Both writers wrote the same shards, byte for byte, in every round.
    digests = result["shard_sha256"]
    assert len(digests["cache()"]) == 1 and digests["cache()"] == digests["cache(durable=False)"]
    markdown = (tmp_path / "cache_overlap.md").read_text()
    assert "| cache() |" in markdown
