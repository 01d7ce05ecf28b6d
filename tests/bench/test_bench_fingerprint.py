"""Smoke test of the weight-fingerprint benchmark: the structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_fingerprint


def test_quick_run_reports_gb_per_s_of_every_digest_on_both_clocks(tmp_path):
    assert bench_fingerprint.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "fingerprint.json").read_text())
    assert payload["benchmark"] == "fingerprint" and payload["environment"]["torch_threads"] == 1
    result = payload["results"]
    assert result["megabytes"] == pytest.approx(8.0) and result["tensors"] == 8
    for clock in ("wall", "cpu"):
        seconds = result["timings"][clock]
        assert set(seconds) == set(bench_fingerprint.VARIANTS)
        for name in bench_fingerprint.VARIANTS:
            (taken,) = seconds[name]["seconds"]
            assert result[clock]["gb_per_s"][name]["median"] == pytest.approx(
                8 * 2**20 / 1e9 / taken
            )
        (raw,) = seconds["raw_xxh3"]["seconds"]
        (ours,) = seconds["xxh3"]["seconds"]
        assert result[clock]["vs_raw_xxh3"]["xxh3"]["median"] == pytest.approx(raw / ours)
    hashed = result["hashed_mib_per_call"]  # what the memo left to read, per variant
    assert hashed == {"xxh3": 8.0, "xxh3_remembered": 0.0, "crc32": 0.0, "sha256": 0.0,
                      "raw_xxh3": 0.0}  # fmt: skip
    markdown = (tmp_path / "fingerprint.md").read_text()
    assert "| xxh3 (graphsplit), first in the process |" in markdown and "sha256" in markdown


def test_fingerprint_benchmark_help(capsys):
    with pytest.raises(SystemExit) as caught:
        bench_fingerprint.main(["--help"])
    assert caught.value.code == 0
    text = capsys.readouterr().out
    for option in ("--mb", "--tensor-mb", "--threads", "--rounds", "--quick"):
        assert option in text
