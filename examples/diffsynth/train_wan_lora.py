"""DiffSynth-Studio's two-stage split training, done by graphsplit on DiffSynth's own Wan step.

DiffSynth splits by hand-declared units: ``--task sft:data_process`` runs the units that need
no trainable model and ``torch.save``s their outputs per sample; ``--task sft:train`` loads them
with ``torch.load(weights_only=False)`` and runs the rest. Here graphsplit finds the boundary
in DiffSynth's unmodified step (``steps.py``), and the same two commands become:

    python -m examples.diffsynth.train_wan_lora --task cache --cache-dir cache/
    python -m examples.diffsynth.train_wan_lora --task train --cache-dir cache/ --output-path out/

``--task full`` trains the unsplit step (the baseline ``train`` reproduces bit for bit). The
model is tiny with random weights and the samples are generated (one per batch, as DiffSynth
trains), so the commands run in seconds on a CPU; for a real model, build the step from your
checkpoints and feed your dataset (PIL frames through ``pipe.preprocess_video``, prompts
through the tokenizer) instead of ``wan_batch``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import graphsplit
from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT, wan_batch, wan_t2v_lora_step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.diffsynth.train_wan_lora")
    parser.add_argument("--task", choices=("full", "cache", "train"), required=True)
    parser.add_argument("--cache-dir", type=Path, help="where stage 1 writes (cache, train)")
    parser.add_argument("--output-path", type=Path, help="LoRA weights and losses (full, train)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if args.task in ("cache", "train") and args.cache_dir is None:
        parser.error(f"--task {args.task} needs --cache-dir")
    if args.task in ("full", "train") and args.output_path is None:
        parser.error(f"--task {args.task} needs --output-path")
    return args


def samples(count: int) -> list[dict]:
    """The dataset, one sample per batch (DiffSynth's collate_fn=lambda x: x[0])."""
    return [dict(wan_batch(seed), key=[f"sample{seed}"]) for seed in range(count)]


def plan() -> tuple[torch.nn.Module, graphsplit.Split]:
    step, example = wan_t2v_lora_step(seed=0)
    return step, graphsplit.split(step, kwargs=example)


def train(step: torch.nn.Module, run_one, count: int, args: argparse.Namespace) -> list[float]:
    """AdamW on the LoRA weights; sample ``i`` of epoch ``e`` draws from seed ``e * count + i``."""
    params = [p for p in step.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    losses = []
    for epoch in range(args.epochs):
        for index in range(count):
            torch.manual_seed(epoch * count + index)
            loss = run_one(index)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


def save(step: torch.nn.Module, losses: list[float], output_path: Path) -> None:
    output_path.mkdir(parents=True, exist_ok=True)
    lora = {name: p.detach().contiguous() for name, p in step.named_parameters() if p.requires_grad}
    save_file(lora, output_path / "lora.safetensors")
    (output_path / "losses.json").write_text(json.dumps(losses) + "\n")
    print(f"trained {len(losses)} steps, last loss {losses[-1]:.6f}; wrote {output_path}")


def task_full(args: argparse.Namespace) -> None:
    step, _ = wan_t2v_lora_step(seed=0)
    data = samples(args.samples)
    inputs = [{k: v for k, v in item.items() if k != "key"} for item in data]
    save(step, train(step, lambda i: step(**inputs[i]), len(data), args), args.output_path)


def task_cache(args: argparse.Namespace) -> None:
    _, split = plan()
    print(split.report())
    info = graphsplit.cache(split, samples(args.samples), args.cache_dir, progress=False)
    print(f"cached {info.num_samples} samples in {args.cache_dir}")


def task_train(args: argparse.Namespace) -> None:
    step, split = plan()
    cached = graphsplit.CachedDataset(args.cache_dir, split=split)
    losses = train(
        step, lambda i: split.stage2(**graphsplit.collate([cached[i]])), len(cached), args
    )
    save(step, losses, args.output_path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not DIFFSYNTH:
        print(f"examples/diffsynth skipped: {WHY_NOT}", file=sys.stderr)
        return 0
    {"full": task_full, "cache": task_cache, "train": task_train}[args.task](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
