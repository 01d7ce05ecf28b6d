"""Step time: the unsplit step vs graphsplit's stage 2 on cached tensors vs a hand-written split.

The hand-written step is what a careful user writes by hand: the denoiser-only training step on
the same precomputed tensors (the VAE distribution's parameters and the text embedding). It is
the ideal graphsplit aims for. All three run interleaved in one process, forward + backward,
and are reported as ratios of medians, because these machines are noisy.

    python -m benchmarks.bench_step_time --help
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import graphsplit
from benchmarks.common import markdown_table, parser, write_results
from benchmarks.hand_written import denoising_loss, example_batch, frozen_outputs


def _timed(fn: Callable[[], torch.Tensor]) -> float:
    started = time.perf_counter()
    fn().backward()
    return time.perf_counter() - started


def measure(size: str, *, rounds: int, warmup: int = 2) -> dict:
    """Median seconds per step of the three variants, and the ratios."""
    from tests.zoo import SD_SIZES, build_sd_lora_step

    config = SD_SIZES[size]
    step = build_sd_lora_step(seed=0, size=size)
    pixels, ids = example_batch(size)
    split = graphsplit.split(step, (pixels, ids))
    with torch.no_grad():
        boundary = split.stage1(pixels, ids)
    hand = frozen_outputs(step, pixels, ids)
    scaling_factor = step.vae.config.scaling_factor
    variants = {
        "unsplit": lambda: step(pixels, ids),
        "graphsplit_stage2": lambda: split.stage2(**boundary),
        "hand_written": lambda: denoising_loss(
            step.unet, step.scheduler, **hand, scaling_factor=scaling_factor
        ),
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
    header = ["mix", "batch × px", "unsplit s", "stage 2 s", "hand-written s",
              "stage2 / hand (≤ 1.02)", "speed-up", "ideal",
              "share of ideal speed-up (≥ 0.97)"]  # fmt: skip
    rows = []
    for r in results:
        m = r["median_seconds"]
        rows.append([
            r["size"], f"{r['batch_size']} × {r['resolution']}", f"{m['unsplit']:.4f}",
            f"{m['graphsplit_stage2']:.4f}", f"{m['hand_written']:.4f}",
            f"{r['stage2_over_hand_written']:.3f}", f"{r['achieved_speedup']:.2f}×",
            f"{r['ideal_speedup']:.2f}×", f"{r['fraction_of_ideal']:.3f}",
        ])  # fmt: skip
    return markdown_table(header, rows, "l" * len(header))


def main(argv: list[str] | None = None) -> int:
    command = parser("bench_step_time", __doc__)
    command.add_argument(
        "--sizes",
        nargs="+",
        default=["small", "heavy_frozen"],
        help="zoo SD sizes to measure (default: small heavy_frozen)",
    )
    command.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    args = command.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    results = [measure(size, rounds=args.rounds) for size in args.sizes]
    write_results(args.out, "step_time", results, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
