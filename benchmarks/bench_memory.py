"""Peak memory: the unsplit training process vs graphsplit's stage 2 vs a hand-written split.

Each variant runs in its own fresh interpreter (``--child VARIANT``) and reports its peak
resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after ``--steps`` training
steps (forward, backward, AdamW on the trainable LoRA weights):

- ``unsplit``: the zoo's SD LoRA step built with real weights, trained on the raw batch.
- ``graphsplit_stage2``: the same step built with ``frozen_on_meta=True`` (VAE and text encoder
  never get real weights), ``graphsplit.split(...)`` in the process, and ``split.stage2``
  trained on the boundary tensors that the parent computed with ``split.stage1`` of a real
  build and saved with ``safetensors.torch.save_file``.
- ``hand_written``: only the LoRA UNet and the scheduler are built; the denoiser-only step a
  user writes by hand trains on the same precomputed tensors (VAE distribution parameters and
  text embedding), also read from a safetensors file.
- ``baseline``: a process that only imports the same libraries (torch, diffusers,
  transformers, peft, safetensors, graphsplit). At small sizes it dominates every RSS, so the
  table also shows each variant's RSS minus the baseline: the share of weights and activations.

    python -m benchmarks.bench_memory                      # sizes heavy_frozen and small
    python -m benchmarks.bench_memory --sizes tiny --steps 1 --out /tmp/results

Writes ``memory.json`` and ``memory.md`` to ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

VARIANTS = ("baseline", "unsplit", "graphsplit_stage2", "hand_written")
PREPARE = "prepare"
DEFAULT_SIZES = ("heavy_frozen", "small")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
SEED = 0
LORA_RANK = 4  # the zoo's default
LEARNING_RATE = 1e-4


def _import_libraries() -> None:
    """What every variant imports, and all the baseline does."""
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import tests.zoo  # noqa: F401


def _max_rss_mib() -> float:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    per_mib = 2**20 if sys.platform == "darwin" else 2**10
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib


# -- the hand-written split -------------------------------------------------------------------
def build_hand_written(size: str):
    """Only the LoRA UNet and the scheduler, built as the zoo builds them (same seed, config)."""
    import torch
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from peft import LoraConfig

    from tests.zoo import SD_SIZES
    from tests.zoo.sd import UNET_LORA_TARGETS

    config = SD_SIZES[size]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED * 16 + 2)
        unet = UNet2DConditionModel(**config.unet)
    unet.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_RANK,
            init_lora_weights="gaussian",
            target_modules=list(UNET_LORA_TARGETS),
        )
    )
    for name, param in unet.named_parameters():
        param.requires_grad_("lora_" in name)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
    return unet.train(), scheduler


def hand_written_loss(unet, scheduler, latent_parameters, text_embedding, scaling_factor=0.18215):
    """The denoiser-only step a user writes on precomputed (VAE parameters, text embedding)."""
    import torch
    import torch.nn.functional as F
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    latents = DiagonalGaussianDistribution(latent_parameters).sample() * scaling_factor
    noise = torch.randn_like(latents)
    timesteps = torch.randint(
        0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
    )
    noisy = scheduler.add_noise(latents, noise, timesteps)
    prediction = unet(noisy, timesteps, text_embedding).sample
    return F.mse_loss(prediction.float(), noise.float())


# -- the child process ------------------------------------------------------------------------
def _train(loss_fn, params, steps: int) -> float:
    import torch

    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE)
    loss = torch.tensor(float("nan"))
    for index in range(steps):
        torch.manual_seed(index)
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(loss)


def run_child(variant: str, size: str, steps: int, data: Path) -> dict[str, Any]:
    """Run one variant in this (fresh) process; its peak RSS and what it held."""
    _import_libraries()
    row: dict[str, Any] = {"variant": variant, "size": size}
    if variant == "baseline":
        row["max_rss_mib"] = _max_rss_mib()
        return row
    import torch
    from safetensors.torch import load_file

    import graphsplit
    from tests.zoo import build_sd_lora_step

    batch = load_file(str(data / "batch.safetensors"))
    if variant == "unsplit":
        step = build_sd_lora_step(seed=SEED, size=size)
        module: torch.nn.Module = step
        loss = _train(
            lambda: step(batch["pixel_values"], batch["input_ids"]), _trainable(step), steps
        )
    elif variant == "graphsplit_stage2":
        step = build_sd_lora_step(seed=SEED, size=size, frozen_on_meta=True)
        split = graphsplit.split(step, (batch["pixel_values"], batch["input_ids"]))
        boundary = load_file(str(data / "boundary.safetensors"))
        if set(boundary) != set(split.boundary):
            raise RuntimeError(f"boundary {sorted(split.boundary)} != cached {sorted(boundary)}")
        del batch
        module = split.stage2
        loss = _train(lambda: split.stage2(**boundary), _trainable(step), steps)
    elif variant == "hand_written":
        unet, scheduler = build_hand_written(size)
        cached = load_file(str(data / "hand_written.safetensors"))
        del batch
        module = unet
        loss = _train(
            lambda: hand_written_loss(
                unet, scheduler, cached["latent_parameters"], cached["text_embedding"]
            ),
            _trainable(unet),
            steps,
        )
    else:
        raise ValueError(f"unknown variant {variant!r}")
    params = list(module.parameters())
    row["real_param_mib"] = (
        sum(p.numel() * p.element_size() for p in params if not p.is_meta) / 2**20
    )
    row["meta_param_mib"] = sum(p.numel() * p.element_size() for p in params if p.is_meta) / 2**20
    row["last_loss"] = loss
    row["max_rss_mib"] = _max_rss_mib()
    return row


def _trainable(module) -> list:
    return [param for param in module.parameters() if param.requires_grad]


# -- the parent process -----------------------------------------------------------------------
def prepare_data(size: str, folder: Path) -> dict[str, Any]:
    """Write the batch, stage 1's boundary and the hand-written step's inputs as safetensors."""
    import torch
    from safetensors.torch import save_file

    import graphsplit
    from tests.zoo import SD_SIZES, CaptionedImages, build_sd_lora_step

    config = SD_SIZES[size]
    dataset = CaptionedImages(length=config.batch_size, resolution=config.resolution)
    items = [dataset[index] for index in range(config.batch_size)]
    pixels = torch.stack([item["pixel_values"] for item in items])
    ids = torch.stack([item["input_ids"] for item in items])
    step = build_sd_lora_step(seed=SEED, size=size)
    split = graphsplit.split(step, (pixels, ids))
    with torch.no_grad():
        boundary = split.stage1(pixels, ids)
        hand = {
            "latent_parameters": step.vae.encode(pixels).latent_dist.parameters,
            "text_embedding": step.text_encoder(ids)[0],
        }
    save_file({"pixel_values": pixels, "input_ids": ids}, str(folder / "batch.safetensors"))
    save_file(_contiguous(boundary), str(folder / "boundary.safetensors"))
    save_file(_contiguous(hand), str(folder / "hand_written.safetensors"))
    params = {
        name: sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
        for name, module in step.named_children()
        if next(module.parameters(), None) is not None
    }
    return {
        "batch_size": config.batch_size,
        "resolution": config.resolution,
        "boundary": {key: list(value.shape) for key, value in boundary.items()},
        "component_param_mib": params,
    }


def _contiguous(tensors: dict) -> dict:
    return {key: value.detach().contiguous() for key, value in tensors.items()}


def run_variant(variant: str, size: str, steps: int, data: Path) -> dict[str, Any]:
    """Run ``--child variant`` in a fresh interpreter and read its JSON line.

    The parent stays small on purpose (it never imports torch): on Linux a child's ru_maxrss
    starts from the RSS of the process that forked it, so a heavy parent would set a floor.
    """
    command = [sys.executable, "-m", "benchmarks.bench_memory", "--child", variant]
    command += ["--sizes", size, "--steps", str(steps), "--data", str(data)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    raise RuntimeError(f"{variant} ({size}) exited {done.returncode}: {tail}")


def measure(size: str, steps: int, jobs: int = 2) -> dict[str, Any]:
    """Peak RSS of each variant in a fresh process, and the ratios.

    ``ru_maxrss`` is per process, so running ``jobs`` children at once does not change it.
    """
    with tempfile.TemporaryDirectory(prefix="graphsplit-bench-memory-") as folder:
        data = Path(folder)
        prepared = run_variant(PREPARE, size, steps, data)
        result: dict[str, Any] = {"size": size, "steps": steps, **prepared}
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {v: pool.submit(run_variant, v, size, steps, data) for v in VARIANTS}
            rows = {variant: future.result() for variant, future in futures.items()}
    rss = {variant: row["max_rss_mib"] for variant, row in rows.items()}
    base = rss["baseline"]
    above = {variant: value - base for variant, value in rss.items() if variant != "baseline"}
    result.update(
        max_rss_mib=rss,
        above_baseline_mib=above,
        real_param_mib={v: rows[v]["real_param_mib"] for v in VARIANTS if v != "baseline"},
        meta_param_mib={v: rows[v]["meta_param_mib"] for v in VARIANTS if v != "baseline"},
        stage2_over_hand_written=rss["graphsplit_stage2"] / rss["hand_written"],
        stage2_over_unsplit=rss["graphsplit_stage2"] / rss["unsplit"],
        above_baseline_stage2_over_hand_written=_ratio(
            above["graphsplit_stage2"], above["hand_written"]
        ),
        above_baseline_stage2_over_unsplit=_ratio(above["graphsplit_stage2"], above["unsplit"]),
    )
    return result


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def environment() -> dict[str, Any]:
    from importlib.metadata import version

    return {
        "torch": version("torch"),
        "diffusers": version("diffusers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def to_markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| mix | batch × px | steps | imports only MiB | unsplit MiB | stage 2 MiB "
        "| hand-written MiB | stage2 / hand (≤ 1.05) | stage2 / unsplit "
        "| above imports: unsplit / stage 2 / hand MiB "
        "| above imports: stage2 / hand | above imports: stage2 / unsplit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        m, a = r["max_rss_mib"], r["above_baseline_mib"]
        lines.append(
            f"| {r['size']} | {r['batch_size']} × {r['resolution']} | {r['steps']} "
            f"| {m['baseline']:.0f} | {m['unsplit']:.0f} | {m['graphsplit_stage2']:.0f} "
            f"| {m['hand_written']:.0f} | {r['stage2_over_hand_written']:.3f} "
            f"| {r['stage2_over_unsplit']:.3f} | {a['unsplit']:.0f} / "
            f"{a['graphsplit_stage2']:.0f} / {a['hand_written']:.0f} "
            f"| {r['above_baseline_stage2_over_hand_written']:.3f} "
            f"| {r['above_baseline_stage2_over_unsplit']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_memory",
        description="Peak RSS of unsplit, graphsplit stage-2 and hand-written training processes.",
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="zoo SD sizes to measure (default: heavy_frozen small)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="training steps per process (default 3)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="folder for memory.json and memory.md (default: benchmarks/results/)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="variant processes run at once; peak RSS is per process (default 2)",
    )
    parser.add_argument("--child", choices=(*VARIANTS, PREPARE), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    if options.child == PREPARE:
        print(json.dumps(prepare_data(options.sizes[0], options.data)), flush=True)
        return 0
    if options.child:
        row = run_child(options.child, options.sizes[0], options.steps, options.data)
        print(json.dumps(row), flush=True)
        return 0
    results = []
    for size in options.sizes:
        result = measure(size, options.steps, options.jobs)
        results.append(result)
        print(f"{size}: {json.dumps(result['max_rss_mib'])}", flush=True)
    options.out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "memory", "environment": environment(), "results": results}
    (options.out / "memory.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = to_markdown(results)
    (options.out / "memory.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
