"""Step time: the unsplit step vs graphsplit's stage 2 on cached tensors vs a hand-written split.

The hand-written step is what a careful user writes by hand: the denoiser-only training step on
the same precomputed tensors (the VAE distribution's parameters and the text embedding). It is
the ideal graphsplit aims for. All three run interleaved in one process, forward + backward,
and are reported as ratios of medians, because these machines are noisy.

    python -m benchmarks.bench_step_time --help
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import graphsplit


def _hand_written_step(step) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The denoiser-only step a user would write on precomputed (parameters, embedding)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    def run(latent_parameters: torch.Tensor, text_embedding: torch.Tensor) -> torch.Tensor:
        latents = DiagonalGaussianDistribution(latent_parameters).sample()
        latents = latents * step.vae.config.scaling_factor
        noise = torch.randn_like(latents)
        timesteps = torch.randint(
            0,
            step.scheduler.config.num_train_timesteps,
            (latents.shape[0],),
            device=latents.device,
        )
        noisy = step.scheduler.add_noise(latents, noise, timesteps)
        prediction = step.unet(noisy, timesteps, text_embedding).sample
        return F.mse_loss(prediction.float(), noise.float())

    return run


def _timed(fn: Callable[[], torch.Tensor]) -> float:
    started = time.perf_counter()
    fn().backward()
    return time.perf_counter() - started


def measure(size: str, *, rounds: int, warmup: int = 2) -> dict:
    """Median seconds per step of the three variants, and the ratios."""
    from tests.zoo import SD_SIZES, CaptionedImages, build_sd_lora_step

    config = SD_SIZES[size]
    step = build_sd_lora_step(seed=0, size=size)
    dataset = CaptionedImages(length=config.batch_size, resolution=config.resolution)
    items = [dataset[index] for index in range(config.batch_size)]
    pixels = torch.stack([item["pixel_values"] for item in items])
    ids = torch.stack([item["input_ids"] for item in items])
    split = graphsplit.split(step, (pixels, ids))
    with torch.no_grad():
        boundary = split.stage1(pixels, ids)
        latent_parameters = step.vae.encode(pixels).latent_dist.parameters
        text_embedding = step.text_encoder(ids)[0]
    hand = _hand_written_step(step)
    variants = {
        "unsplit": lambda: step(pixels, ids),
        "graphsplit_stage2": lambda: split.stage2(**boundary),
        "hand_written": lambda: hand(latent_parameters, text_embedding),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for index in range(warmup + rounds):
        # Rotate the order every round: a variant that always runs right after the unsplit
        # step (which churns the allocator and caches) would otherwise be biased.
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            fn = variants[name]
            for param in step.parameters():
                param.grad = None
            torch.manual_seed(index)
            elapsed = _timed(fn)
            if index >= warmup:
                times[name].append(elapsed)
    median = {name: statistics.median(values) for name, values in times.items()}
    ideal = median["unsplit"] / median["hand_written"]
    achieved = median["unsplit"] / median["graphsplit_stage2"]
    return {
        "size": size,
        "batch_size": config.batch_size,
        "resolution": config.resolution,
        "rounds": rounds,
        "median_seconds": median,
        "stage2_over_hand_written": median["graphsplit_stage2"] / median["hand_written"],
        "ideal_speedup": ideal,
        "achieved_speedup": achieved,
        "fraction_of_ideal": (achieved - 1) / (ideal - 1) if ideal > 1 else float("nan"),
    }


def to_markdown(results: list[dict]) -> str:
    lines = [
        "| mix | batch × px | unsplit s | stage 2 s | hand-written s | stage2 / hand (≤ 1.02) "
        "| speed-up | ideal | share of ideal speed-up (≥ 0.97) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["median_seconds"]
        lines.append(
            f"| {r['size']} | {r['batch_size']} × {r['resolution']} | {m['unsplit']:.4f} | "
            f"{m['graphsplit_stage2']:.4f} | {m['hand_written']:.4f} | "
            f"{r['stage2_over_hand_written']:.3f} | {r['achieved_speedup']:.2f}× | "
            f"{r['ideal_speedup']:.2f}× | {r['fraction_of_ideal']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["small", "heavy_frozen"],
        help="zoo SD sizes to measure (default: small heavy_frozen)",
    )
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results"),
        help="folder for step_time.json and step_time.md",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    results = [measure(size, rounds=args.rounds) for size in args.sizes]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_time.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = to_markdown(results)
    (args.out / "step_time.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
