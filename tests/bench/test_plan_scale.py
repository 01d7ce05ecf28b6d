"""Smoke test of benchmarks/bench_plan_scale.py on the tiny case: output structure, not speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_plan_scale


def test_help_lists_the_cases(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_plan_scale.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in ("--cases", "--out", "--batch", "--rounds", "--threads", "--quick", "sdxl"):
        assert option in text


def test_tiny_case_writes_json_and_markdown(tmp_path):
    assert bench_plan_scale.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "plan_scale.json").read_text())
    assert report["benchmark"] == "plan_scale"
    assert {"torch", "diffusers", "transformers", "cpus"} <= set(report["environment"])
    (row,) = report["results"]
    assert row["case"] == "tiny" and row["status"] == "ok"
    assert row["all_params_on_meta"] is True
    assert row["split_seconds"] > 0 and row["peak_python_mib"] > 0 and row["max_rss_mib"] > 0
    assert row["torch_threads"] == 1  # the child runs single-threaded by default
    for clock in ("split_wall_seconds", "split_cpu_seconds"):
        spread = row[clock]
        assert spread["count"] == 1 and spread["q1"] <= spread["median"] <= spread["q3"]
    assert row["graph_nodes"] > 0 and row["frozen_modules_in_stage2"] == []
    assert set(row["boundary"]) == {"vae_encode_latent_dist_parameters", "text_encoder_0"}
    table = (tmp_path / "plan_scale.md").read_text().splitlines()
    assert table[0].startswith("| case | batch |")
    assert table[2].startswith("| tiny | 2 |")


def test_a_failing_case_is_recorded_not_raised(monkeypatch):
    def broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setitem(bench_plan_scale.BUILDERS, "tiny", broken)
    row = bench_plan_scale.measure_case("tiny")
    assert row["status"] == "failed: RuntimeError: boom"
    assert "| tiny | 2 |" in bench_plan_scale.to_markdown([row])
