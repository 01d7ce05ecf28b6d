"""examples/sd_spec.py end to end: inspect it, cache it with --verify, check the cache, and
read it back as stage 2's batches (a real diffusers/transformers/peft step)."""

from pathlib import Path

import pytest

pytest.importorskip("diffusers")

from graphsplit import CachedDataset
from graphsplit.tools.cli import main

SD_SPEC = Path(__file__).resolve().parents[2] / "examples" / "sd_spec.py"


@pytest.mark.slow
def test_inspect_the_sd_spec(tmp_path, capsys):
    assert main(["inspect", f"{SD_SPEC}:step", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "graphsplit plan for SDLoRAStep" in out
    assert "vae_encode" in out and "text_encoder" in out  # both frozen encoders are cached
    for name in ("stage1.py", "stage2.py", "plan.json", "split.html"):
        assert (tmp_path / name).is_file(), name


@pytest.mark.slow
def test_cache_the_sd_spec_with_verify(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["cache", f"{SD_SPEC}:step", "--out", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert printed.index("graphsplit plan for SDLoRAStep") < printed.index("verified")
    assert "bit for bit" in printed and "8 samples" in printed
    assert main(["check-cache", str(out)]) == 0
    cached = CachedDataset(out)
    assert len(cached) == 8
    sample = cached[0]
    assert sample["key"] == "sample-000000"
    assert sorted(name for name in sample if name != "key") == [
        "text_encoder_0",
        "vae_encode_latent_dist_parameters",
    ]
