"""Smoke test of benchmarks/bench_split_scale.py at tiny sizes: output structure, not speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_split_scale


def test_help_describes_the_options(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_split_scale.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in ("--sizes", "--full", "--out", "--repeat"):
        assert option in text


def test_build_step_has_about_the_requested_number_of_nodes():
    model, args = bench_split_scale.build_step(40)
    split = bench_split_scale.graphsplit.split(model, args)
    assert abs(len(split.graph.nodes) - 40) <= bench_split_scale.NODES_PER_BLOCK
    # The frozen prefix is cached: the cut falls inside the chain, not at the input.
    assert list(split.boundary) != ["x"]
    assert len(split.cut.stage2) < len(split.graph.nodes)


def test_tiny_run_writes_json_and_markdown(tmp_path, capsys):
    argv = ["--sizes", "10", "16", "--repeat", "1", "--out", str(tmp_path)]
    assert bench_split_scale.main(argv) == 0
    report = json.loads((tmp_path / "bench_split_scale.json").read_text())
    assert report["benchmark"] == "split_scale"
    assert {"torch", "python", "graphsplit", "cpus"} <= set(report["environment"])
    assert [row["nodes"] for row in report["results"]] == [10, 16]
    for row in report["results"]:
        assert row["graph_nodes"] > 0 and row["boundary_tensors"] >= 1
        assert row["seconds"] > 0 and len(row["seconds_all"]) == 1
        assert row["peak_python_mib"] > 0 and row["max_rss_mib"] > 0
    table = (tmp_path / "bench_split_scale.md").read_text().splitlines()
    header = next(index for index, line in enumerate(table) if line.startswith("| nodes"))
    assert table[header + 1].startswith("|---:")
    assert [line.split("|")[1].strip() for line in table[header + 2 :]] == ["10", "16"]
    assert "bench_split_scale.json" in capsys.readouterr().out
