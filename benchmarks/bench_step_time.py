"""Step time: the unsplit step vs graphsplit's stage 2 on cached tensors vs a hand-written split.

The hand-written step is what a careful user writes by hand: the denoiser-only training step on
the same precomputed tensors (the VAE distribution's parameters and the text embedding). It is
the ideal graphsplit aims for. All three run forward + backward in one process, interleaved
round by round (:func:`benchmarks.common.interleaved`), on one torch thread by default; the
report gives the median and IQR of same-round ratios, on wall-clock and on CPU time, because
these machines are shared and noisy.

    python -m benchmarks.bench_step_time --help
    python -m benchmarks.bench_step_time --quick --out /tmp/results     # smoke test
"""

from __future__ import annotations

from typing import Any

import torch

import graphsplit
from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    report,
    spread,
    timing_options,
    torch_threads,
    write_results,
)
from benchmarks.hand_written import denoising_loss, example_batch, frozen_outputs

DEFAULT_SIZES = ("small", "heavy_frozen")
# stage 2 and the hand-written step sit next to each other in both orders of a round.
VARIANTS = ("graphsplit_stage2", "hand_written", "unsplit")


def measure(size: str, *, rounds: int, warmup: int = 2) -> dict[str, Any]:
    """Seconds per step of the three variants, and their same-round ratios with spread."""
    from tests.zoo import SD_SIZES, build_sd_lora_step

    config = SD_SIZES[size]
    step = build_sd_lora_step(seed=0, size=size)
    pixels, ids = example_batch(size)
    split = graphsplit.split(step, (pixels, ids))
    with torch.no_grad():
        boundary = split.stage1(pixels, ids)
    hand = frozen_outputs(step, pixels, ids)
    scaling_factor = step.vae.config.scaling_factor
    losses = {
        "unsplit": lambda: step(pixels, ids),
        "graphsplit_stage2": lambda: split.stage2(**boundary),
        "hand_written": lambda: denoising_loss(
            step.unet, step.scheduler, **hand, scaling_factor=scaling_factor
        ),
    }
    variants = {name: (lambda loss=losses[name]: loss().backward()) for name in VARIANTS}

    def before_each(name: str, index: int) -> None:
        for param in step.parameters():
            param.grad = None
        torch.manual_seed(index)

    timings = interleaved(variants, rounds=rounds, warmup=warmup, before_each=before_each)
    result: dict[str, Any] = {
        "size": size,
        "batch_size": config.batch_size,
        "resolution": config.resolution,
        "rounds": rounds,
        "timings": timings.to_json(),
    }
    for clock in ("wall", "cpu"):
        unsplit, stage2, hand_s = (timings.seconds(n, clock) for n in VARIANTS[::-1])
        shares = [(u / s - 1) / (u / h - 1) for u, s, h in zip(unsplit, stage2, hand_s) if u > h]
        result[clock] = {
            "median_seconds": {name: timings.spread(name, clock).median for name in VARIANTS},
            "stage2_over_hand_written": timings.ratio(
                "graphsplit_stage2", "hand_written", clock
            ).to_json(),
            "speedup": timings.ratio("unsplit", "graphsplit_stage2", clock).to_json(),
            "ideal_speedup": timings.ratio("unsplit", "hand_written", clock).to_json(),
            "share_of_ideal": spread(shares).to_json() if shares else None,
        }
    return result


def _cell(value: dict[str, float] | None, spec: str = ".3f") -> str:
    if value is None:
        return "–"
    return f"{value['median']:{spec}} ({value['q1']:{spec}}–{value['q3']:{spec}})"


def to_markdown(results: list[dict[str, Any]], threads: int) -> str:
    header = ["mix", "batch × px", "clock", "unsplit s", "stage 2 s", "hand-written s",
              "stage2 / hand (0.95–1.05)", "speed-up", "ideal", "share of ideal"]  # fmt: skip
    rows = []
    for r in results:
        for clock in ("wall", "cpu"):
            c = r[clock]
            m = c["median_seconds"]
            rows.append([
                r["size"], f"{r['batch_size']} × {r['resolution']}", clock,
                f"{m['unsplit']:.4f}", f"{m['graphsplit_stage2']:.4f}",
                f"{m['hand_written']:.4f}", _cell(c["stage2_over_hand_written"]),
                _cell(c["speedup"], ".2f"), _cell(c["ideal_speedup"], ".2f"),
                _cell(c["share_of_ideal"], ".2f"),
            ])  # fmt: skip
    rounds = results[0]["rounds"] if results else 0
    return (
        f"Median (IQR) of same-round ratios over {rounds} rounds, {threads} torch thread(s); "
        "seconds are medians.\n\n" + markdown_table(header, rows, "lllrrrrrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_step_time", __doc__), rounds=40)
    command.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="zoo SD sizes to measure (default: small heavy_frozen)",
    )
    args = command.parse_args(argv)
    sizes, rounds, warmup = (["tiny"], 2, 1) if args.quick else (args.sizes, args.rounds, 2)
    with torch_threads(args.threads) as threads:
        results = [measure(size, rounds=rounds, warmup=warmup) for size in sizes]
        where = environment("torch", "diffusers", torch_threads=True)
    payload = report("step_time", results, where)
    write_results(args.out, "step_time", payload, to_markdown(results, threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
