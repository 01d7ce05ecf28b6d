"""examples/train_split.py end to end at the tiny size: full, cache (two processes), train.

``train`` on one process must reproduce ``full`` bit for bit (losses and LoRA weights), the
two-process cache must pass ``check_cache``, and the saved checkpoint must load into a fresh
peft-wrapped UNet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

import graphsplit
from tests.helpers import free_port
from tests.zoo.sd import build_sd_lora_step

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_split.py"
# 8 samples of about 10.5 KB in batches of 2: 50 KB shards hold 2 batches: 2 shards.
COMMON = ["--size", "tiny", "--num-samples", "8", "--batch-size", "2", "--seed", "3"]
TRAIN = ["--steps", "3", "--lr", "1e-3"]


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("ACCELERATE_CONFIG_FILE", None)
    return env


def run(command: list[str], cwd: Path) -> str:
    finished = subprocess.run(
        command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-4000:]
    return finished.stdout


def test_cache_then_train_reproduces_full_and_saves_a_loadable_lora(tmp_path):
    full, split, cache = tmp_path / "full", tmp_path / "split", tmp_path / "cache"
    python = [sys.executable, str(SCRIPT)]
    run([*python, "--task", "full", "--output-dir", str(full), *COMMON, *TRAIN], tmp_path)

    # `--multi_gpu` selects accelerate's torchrun launcher; the script's Accelerator(cpu=True)
    # (no CUDA here) makes it a two-process CPU (gloo) run, as in test_cache_multiprocess.py.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    launch += ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    launch += ["--dynamo_backend", "no", "--main_process_port", str(free_port())]
    out = run(
        [*launch, str(SCRIPT), "--task", "cache", "--cache-dir", str(cache), "--shard-bytes",
         "50000", *COMMON],
        tmp_path,
    )  # fmt: skip
    assert "graphsplit plan for training_step" in out
    assert out.count("graphsplit plan") == 1  # the report is printed by the main process only
    report = graphsplit.check_cache(cache)
    assert report.ok, report
    assert (report.num_samples, report.num_shards) == (8, 2)  # one shard per process

    # train refuses a cache made by another step (other stage-1 code and boundary)
    toy = torch.nn.Sequential(torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Linear(4, 1))
    other = graphsplit.split(toy, (torch.randn(2, 4),))
    with pytest.raises(graphsplit.GraphsplitError, match="not made by this split"):
        graphsplit.CachedDataset(cache, other)

    run(
        [*python, "--task", "train", "--cache-dir", str(cache), "--output-dir", str(split),
         *COMMON, *TRAIN],
        tmp_path,
    )  # fmt: skip
    full_losses = json.loads((full / "losses.json").read_text())
    split_losses = json.loads((split / "losses.json").read_text())
    assert len(full_losses) == 3
    assert split_losses == full_losses  # bit for bit: same seeds, same batches, same order

    trained = load_file(full / "pytorch_lora_weights.safetensors")
    checkpoint = load_file(split / "pytorch_lora_weights.safetensors")
    assert checkpoint.keys() == trained.keys()
    assert all(".lora_A." in key or ".lora_B." in key for key in checkpoint)

    fresh = build_sd_lora_step(seed=3).unet  # peft LoRA injected, untrained weights
    initial = get_peft_model_state_dict(fresh)
    assert initial.keys() == checkpoint.keys()
    assert any(not torch.equal(initial[key], trained[key]) for key in trained)  # it trained
    result = set_peft_model_state_dict(fresh, checkpoint)
    assert not [key for key in result.missing_keys if "lora_" in key]
    assert not result.unexpected_keys
    loaded = get_peft_model_state_dict(fresh)
    assert all(torch.equal(loaded[key], trained[key]) for key in trained)
