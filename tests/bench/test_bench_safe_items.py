"""Smoke test of the safe-items benchmark: the structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_safe_items


def test_quick_run_reports_both_costs_on_both_clocks(tmp_path):
    assert bench_safe_items.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "safe_items.json").read_text())
    assert payload["benchmark"] == "safe_items" and payload["environment"]["torch_threads"] == 1
    items, prints = payload["results"]["items"], payload["results"]["fingerprint"]
    assert items["samples"] == 16 and items["batch"] == 4
    for clock in ("wall", "cpu"):
        seconds = items["timings"][clock]
        assert set(seconds) == {"view items", "copied items", "view batches", "copied batches"}
        (copied,) = seconds["copied items"]["seconds"]
        (views,) = seconds["view items"]["seconds"]
        assert items["ratios"][clock]["items"]["median"] == pytest.approx(copied / views)
        assert set(prints["timings"][clock]) == {"version counter only", "with sampled elements"}
    markdown = (tmp_path / "safe_items.md").read_text()
    assert "| epoch of items |" in markdown and "remembered fingerprint" in markdown


def test_the_view_baseline_reads_what_the_dataset_reads(tmp_path):
    from graphsplit.caching.read.dataset import CachedDataset

    bench_safe_items.measure_items(16, 4, 1, tmp_path)
    cached = CachedDataset(tmp_path)
    for index in range(len(cached)):
        view, copy = bench_safe_items._view_item(cached, index), cached[index]
        assert view.keys() == copy.keys()
        assert all(view[n].equal(copy[n]) for n in view if n != "key")
