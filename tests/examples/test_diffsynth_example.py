"""examples/diffsynth/train_wan_lora.py: cache with one command, train stage 2 with another.

On DiffSynth's own Wan step, ``train`` from the cache must reproduce ``full`` (the unsplit
step) bit for bit: losses and LoRA weights. Skipped, with the reason printed, where
``diffsynth`` cannot be imported.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    print(f"tests/examples/test_diffsynth_example.py skipped: {WHY_NOT}", file=sys.stderr)
    pytest.skip(WHY_NOT, allow_module_level=True)

from safetensors.torch import load_file

from examples.diffsynth import train_wan_lora

pytestmark = pytest.mark.slow


def test_the_commands_refuse_missing_folders_with_a_usage_message(capsys):
    with pytest.raises(SystemExit):
        train_wan_lora.main(["--task", "cache"])
    assert "--task cache needs --cache-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_wan_lora.main(["--task", "train", "--cache-dir", "c"])
    assert "--task train needs --output-path" in capsys.readouterr().err


def test_cache_then_train_reproduces_the_unsplit_training_bit_for_bit(tmp_path):
    common = ["--samples", "3", "--epochs", "2"]
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert train_wan_lora.main(["--task", "cache", *cache, *common]) == 0
    assert (tmp_path / "cache" / "manifest.json").is_file()
    assert not list((tmp_path / "cache").rglob("*.pth"))  # safetensors, no pickle
    train = ["--output-path", str(tmp_path / "train")]
    assert train_wan_lora.main(["--task", "train", *cache, *train, *common]) == 0
    full = ["--output-path", str(tmp_path / "full")]
    assert train_wan_lora.main(["--task", "full", *full, *common]) == 0
    losses = json.loads((tmp_path / "train" / "losses.json").read_text())
    assert len(losses) == 6
    assert losses == json.loads((tmp_path / "full" / "losses.json").read_text())
    trained = load_file(tmp_path / "train" / "lora.safetensors")
    baseline = load_file(tmp_path / "full" / "lora.safetensors")
    assert trained.keys() == baseline.keys() and trained
    assert all(torch.equal(trained[name], baseline[name]) for name in trained)
