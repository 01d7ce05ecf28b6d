"""Smoke test of benchmarks/bench_split_scale.py at tiny sizes: output structure, not speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_split_scale
from benchmarks.common import REPOSITORY


def test_help_describes_the_options(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_split_scale.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in ("--sizes", "--full", "--out", "--rounds", "--threads", "--quick"):
        assert option in text


def test_build_step_has_about_the_requested_number_of_nodes():
    model, args = bench_split_scale.build_step(40)
    split = bench_split_scale.graphsplit.split(model, args)
    assert abs(len(split.graph.nodes) - 40) <= bench_split_scale.NODES_PER_BLOCK
    # The frozen prefix is cached: the cut falls inside the chain, not at the input.
    assert list(split.boundary) != ["x"]
    assert len(split.cut.stage2) < len(split.graph.nodes)


def test_tiny_run_writes_json_and_markdown(tmp_path, capsys):
    argv = ["--sizes", "10", "16", "--rounds", "2", "--out", str(tmp_path)]
    assert bench_split_scale.main(argv) == 0
    report = json.loads((tmp_path / "bench_split_scale.json").read_text())
    assert report["benchmark"] == "split_scale"
    assert {"torch", "python", "graphsplit", "cpus"} <= set(report["environment"])
    assert [row["nodes"] for row in report["results"]] == [10, 16]
    for row in report["results"]:
        assert row["graph_nodes"] > 0 and row["boundary_tensors"] >= 1
        assert row["seconds"] > 0 and len(row["seconds_all"]) == 2
        for clock in ("wall_seconds", "cpu_seconds"):
            spread = row[clock]
            assert spread["count"] == 2 and spread["q1"] <= spread["median"] <= spread["q3"]
        assert row["seconds"] == row["wall_seconds"]["median"]
        assert row["peak_python_mib"] > 0 and row["max_rss_mib"] > 0
    table = (tmp_path / "bench_split_scale.md").read_text().splitlines()
    header = next(index for index, line in enumerate(table) if line.startswith("| nodes"))
    assert table[header + 1].startswith("|---:")
    assert [line.split("|")[1].strip() for line in table[header + 2 :]] == ["10", "16"]
    assert "bench_split_scale.json" in capsys.readouterr().out
    assert report["environment"]["torch_threads"] == 1


def test_quick_run_is_two_small_graphs_once(tmp_path):
    assert bench_split_scale.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_split_scale.json").read_text())
    assert [row["nodes"] for row in report["results"]] == [10, 40]
    assert all(row["wall_seconds"]["count"] == 1 for row in report["results"])


def test_baseline_run_compares_alternating_children_and_their_plans(tmp_path):
    # The baseline is this checkout itself (a folder holding graphsplit): the same plan.
    argv = ["--sizes", "10", "--rounds", "1", "--baseline", str(REPOSITORY)]
    assert bench_split_scale.main([*argv, "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "bench_split_scale.json").read_text())["results"]
    versus = row["versus_baseline"]
    assert versus["same_plan"] is True and versus["rounds"] == 1
    for clock in ("cpu", "wall"):
        assert set(versus["timings"][clock]) == {"current", "baseline"}
        assert versus[f"{clock}_ratio"]["count"] == 1 and versus[f"{clock}_ratio"]["median"] > 0
    assert "Against the baseline" in (tmp_path / "bench_split_scale.md").read_text()


def test_repeated_children_time_several_splits_in_one_process(tmp_path):
    row = bench_split_scale.measure_once(10, repeated=3)
    assert len(row["cpu_all"]) == 3 and row["cpu"] == sorted(row["cpu_all"])[1]
    argv = ["--sizes", "10", "--rounds", "1", "--repeated", "2", "--baseline", str(REPOSITORY)]
    assert bench_split_scale.main([*argv, "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "bench_split_scale.json").read_text())["results"]
    versus = result["versus_baseline"]
    assert versus["repeated"] == 2 and versus["same_plan"] is True
    assert "10, 2 repeated splits per child" in (tmp_path / "bench_split_scale.md").read_text()
