"""The GPU benchmark's dry run (CPU, tiny configs, float32): the script runs end to end."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import gpu


@pytest.mark.slow
def test_dry_run_measures_both_mixes_and_their_losses_agree(tmp_path):
    assert gpu.main(["--dry-run", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "gpu.json").read_text())
    rows = {row["mix"]: row for row in payload["results"]}
    assert set(rows) == {"sd15", "flux"}
    for row in rows.values():
        assert row["status"] == "ok" and (row["device"], row["dtype"]) == ("cpu", "float32")
        # Unsplit, stage 2 from stage 1, and the hand-written step: the same loss, bit for bit.
        losses = row["losses"]
        assert losses["bit_identical"] is True
        assert losses["unsplit"] == losses["stage2"] == losses["hand_written"]
        caching = row["caching"]
        assert caching["samples"] == 8 and caching["samples_per_second"] > 0
        assert caching["bytes"] > 0 and caching["writer_share"] > 0
        assert caching["gpu_utilization_percent"] is None  # no GPU to sample
        for clock in ("wall", "cpu"):
            assert set(row["timings"][clock]) == set(gpu.VARIANTS)
            assert set(gpu.RATIOS) <= set(row[clock])
        # Stage 2 holds no frozen encoder: what the hand-written step holds (the denoiser),
        # give or take a few small constants (the scheduler's table), far less than unsplit.
        held = {name: value["held_gib"] for name, value in row["memory"].items()}
        assert held["stage2"] == pytest.approx(held["hand_written"], rel=0.02)
        assert held["unsplit"] > 1.5 * held["stage2"]
    markdown = (tmp_path / "gpu.md").read_text()
    assert "| sd15 | 2 × 32 |" in markdown and "| flux | 1 × 32 |" in markdown


def test_without_a_gpu_the_script_says_to_use_the_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        gpu.main(["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err and "--dry-run" in "".join(
        gpu.main.__doc__ or "--dry-run"
    )


def test_prefetcher_cycles_epochs_and_yields_every_batch():
    loader = [{"x": gpu.torch.tensor([index])} for index in range(2)]
    prefetcher = gpu.DevicePrefetcher(loader, gpu.torch.device("cpu"))
    assert [int(prefetcher.next()["x"]) for _ in range(5)] == [0, 1, 0, 1, 0]
