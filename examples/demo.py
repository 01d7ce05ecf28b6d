"""``make demo`` (``python -m examples.demo``): the main job end to end on a small LoRA step.

1. split the step (real diffusers VAE + UNet with peft LoRA, transformers CLIP text encoder;
   tiny configs, random weights) and print the plan;
2. cache the procedural image-caption dataset through stage 1 (progress bar);
3. train the same steps twice, each in a fresh process so peak memory is its own: the unsplit
   step on raw images, and stage 2 on the cache with the VAE and text encoder on ``meta``;
4. print both side by side: loss per step (equal, same seeds), step time, peak memory, cache size.

Nothing is downloaded; it needs the ``hf`` extra (diffusers, transformers, peft).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

import graphsplit
from benchmarks.common import peak_rss_bytes
from graphsplit.units import human_bytes
from tests.zoo import SD_SIZES, CaptionedImages, build_sd_lora_step


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo run; the defaults take about 30 s of CPU time (one thread per process)."""

    samples: int = 8
    batch_size: int = 4
    resolution: int = 128
    size: str = "heavy_frozen"  # a key of tests.zoo.SD_SIZES; "tiny" for the test suite
    steps: int = 3
    seed: int = 0
    learning_rate: float = 1e-3


def _dataset(config: DemoConfig):
    return CaptionedImages(length=config.samples, resolution=config.resolution, seed=config.seed)


def _raw_batches(config: DemoConfig):
    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return default_collate([{k: v for k, v in item.items() if k != "key"} for item in items])

    return DataLoader(_dataset(config), batch_size=config.batch_size, collate_fn=collate)


def _example(config: DemoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    batch = next(iter(_raw_batches(config)))
    return batch["pixel_values"], batch["input_ids"]


def _train(model: torch.nn.Module, params: list, batches, config: DemoConfig) -> dict[str, Any]:
    """``config.steps`` AdamW steps; the seed before each step fixes its random draws."""
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate)
    losses, times, cpu_times = [], [], []
    iterator = iter(batches)
    for index in range(config.steps):
        try:
            batch = next(iterator)
        except StopIteration:
            iterator = iter(batches)
            batch = next(iterator)
        torch.manual_seed(config.seed * 1000 + index)
        started, started_cpu = time.perf_counter(), time.process_time()
        loss = model(**batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - started_cpu)
        losses.append(loss.item())
    return {"losses": losses, "step_seconds": times, "step_cpu_seconds": cpu_times}


def _held_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)


def _run_unsplit(config: DemoConfig) -> dict[str, Any]:
    step = build_sd_lora_step(seed=config.seed, size=config.size)
    params = [p for p in step.parameters() if p.requires_grad]
    result = _train(step, params, _raw_batches(config), config)
    return {**result, "weights_bytes": _held_bytes(step)}


def _run_stage2(config: DemoConfig, cache_dir: str) -> dict[str, Any]:
    step = build_sd_lora_step(
        seed=config.seed, size=config.size, frozen_on_meta=True
    )  # never loads VAE/CLIP
    split = graphsplit.split(step, _example(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "frozen weights on meta": expected in this process
        dataset = graphsplit.CachedDataset(cache_dir, split)
    loader = DataLoader(dataset, batch_size=config.batch_size, collate_fn=graphsplit.collate)
    params = [p for p in split.stage2.parameters() if p.requires_grad]
    result = _train(split.stage2, params, loader, config)
    return {**result, "weights_bytes": _held_bytes(split.stage2)}


def _child(name: str, config: DemoConfig, cache_dir: str, queue) -> None:
    # One thread each: on a shared machine extra threads only add spinning and noise, and
    # the two variants then compare the work they do, not how the scheduler treated them.
    torch.set_num_threads(1)
    result = _run_unsplit(config) if name == "unsplit" else _run_stage2(config, cache_dir)
    result["peak_rss_bytes"] = peak_rss_bytes()
    queue.put(json.dumps(result))


def _in_fresh_process(name: str, config: DemoConfig, cache_dir: str) -> dict[str, Any]:
    """Run one variant in a spawned process: its peak RSS is its own, not the parent's."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(name, config, cache_dir, queue))
    process.start()
    result = json.loads(queue.get(timeout=900))
    process.join()
    return result


def _mean_after_first(result: dict[str, Any], field: str = "step_seconds") -> float:
    """Mean step time without step 1, which pays the first-call costs (unless it is alone)."""
    seconds = result[field]
    return sum(seconds[1:] or seconds) / max(len(seconds) - 1, 1)


def side_by_side(unsplit: dict[str, Any], stage2: dict[str, Any], cache_bytes: int) -> str:
    """The closing table: losses per step, then time, memory and disk."""
    rows = [("", "unsplit step", "graphsplit stage 2")]
    for index, (a, b) in enumerate(zip(unsplit["losses"], stage2["losses"])):
        rows.append((f"loss, step {index + 1}", f"{a:.6f}", f"{b:.6f}"))
    mean_a, mean_b = _mean_after_first(unsplit), _mean_after_first(stage2)
    cpu_a = _mean_after_first(unsplit, "step_cpu_seconds")
    cpu_b = _mean_after_first(stage2, "step_cpu_seconds")
    rows += [
        ("step time (mean after step 1)", f"{mean_a * 1000:.0f} ms", f"{mean_b * 1000:.0f} ms"),
        ("step CPU time", f"{cpu_a * 1000:.0f} ms",
         f"{cpu_b * 1000:.0f} ms ({cpu_a / max(cpu_b, 1e-9):.1f}x less)"),
        ("weights held", human_bytes(unsplit["weights_bytes"]),
         human_bytes(stage2["weights_bytes"])),
        ("peak RSS of the process", human_bytes(unsplit["peak_rss_bytes"]),
         human_bytes(stage2["peak_rss_bytes"])),
        ("cache on disk", "-", human_bytes(cache_bytes)),
    ]  # fmt: skip
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def run_demo(config: DemoConfig | None = None, *, out: str | None = None) -> int:
    """Split, cache, train both ways and print the comparison; returns the exit code."""
    config = config or DemoConfig()
    # The same thread count as the training processes below: CPU kernels may sum in another
    # order with more threads, and the unsplit step must see the bits the cache holds.
    torch.set_num_threads(1)
    step = build_sd_lora_step(seed=config.seed, size=config.size)
    started = time.perf_counter()
    split = graphsplit.split(step, _example(config))
    print(split.report())
    print(f"\nsplit() took {time.perf_counter() - started:.2f} s\n")
    with tempfile.TemporaryDirectory(prefix="graphsplit-demo-") as scratch:
        cache_dir = out or str(Path(scratch) / "cache")
        loader = DataLoader(_dataset(config), batch_size=config.batch_size)
        info = graphsplit.cache(split, loader, cache_dir, overwrite=True)
        print(f"{info}\n")
        print("training the unsplit step and stage 2, each in a fresh process ...\n")
        unsplit = _in_fresh_process("unsplit", config, cache_dir)
        stage2 = _in_fresh_process("stage2", config, cache_dir)
        print(side_by_side(unsplit, stage2, info.total_bytes))
    equal = unsplit["losses"] == stage2["losses"]
    verdict = "equal bit for bit" if equal else "DIFFERENT"
    print(f"\nlosses {verdict}: same seeds, same batches, stage 2 trains from the cache")
    print(
        "(CPU time is the steadier figure on a shared machine; peak RSS includes torch and "
        "diffusers themselves, about 0.5 GiB. docs/benchmarks.md has the measured ratios.)"
    )
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.demo [--samples N] [--batch-size N] [--resolution PX] [--steps N]``."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Split a text-to-image LoRA step (random weights), cache its dataset, "
        "train stage 2 and the unsplit step side by side.",
    )
    parser.add_argument("--samples", type=int, default=8, help="dataset length (default 8)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch (default 4)")
    parser.add_argument(
        "--resolution", type=int, default=128, help="image size in px (default 128)"
    )
    parser.add_argument(
        "--size",
        default="heavy_frozen",
        choices=sorted(SD_SIZES),
        help="model size from tests/zoo (default heavy_frozen: the frozen VAE and text encoder "
        "dominate the step, as in real fine-tuning)",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--out", help="keep the cache in this folder (default: a temporary one)")
    args = parser.parse_args(argv)
    config = DemoConfig(
        samples=args.samples,
        batch_size=args.batch_size,
        resolution=args.resolution,
        size=args.size,
        steps=args.steps,
    )
    return run_demo(config, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
