"""Cache while training: the first epoch with a LiveCache against plain training (the unsplit step).

One round is one epoch of the demo's step (``examples/demo.py``: tiny SD LoRA step, procedural
captioned images, AdamW) over a shuffled loader, in two variants: ``plain`` trains the unsplit
step on raw batches; ``live`` trains through ``LiveCache.step`` into a fresh folder (stage 1,
the rows handed to the background writer, stage 2) and ends with ``finish()`` (the last shard,
the manifest, durable by default). Both load the same raw batches. The variants alternate
within each round (:func:`benchmarks.common.interleaved`), one torch thread; the report gives
the median and IQR of same-round ratios ``live / plain`` on wall-clock and CPU time (the writer's
threads hash and save beside the step, so CPU time shows what they cost even where wall-clock
hides it). The target is ``live / plain <= 1.05``.

    python -m benchmarks.bench_live_cache --help
    python -m benchmarks.bench_live_cache --quick --out /tmp/results     # smoke test
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import graphsplit
from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    report,
    timing_options,
    torch_threads,
    write_results,
)

VARIANTS = ("plain", "live")


def measure(
    size: str, *, samples: int, batch_size: int, resolution: int, rounds: int, warmup: int
) -> dict[str, Any]:
    """Seconds per epoch of both variants and their same-round ratio, on both clocks."""
    from tests.zoo import CaptionedImages, build_sd_lora_step

    step = build_sd_lora_step(seed=0, size=size)
    dataset = CaptionedImages(length=samples, resolution=resolution, seed=0)
    epoch = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    example = next(iter(epoch))
    split = graphsplit.split(step, (example["pixel_values"], example["input_ids"]))
    params = [p for p in step.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    folder = Path(tempfile.mkdtemp(prefix="bench-live-"))

    def train(loss_of) -> None:
        for batch in epoch:
            loss = loss_of(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def plain() -> None:
        train(lambda batch: step(batch["pixel_values"], batch["input_ids"]))

    def live() -> None:
        with graphsplit.LiveCache(split, folder / "cache") as writer:
            train(writer.step)

    def before_each(name: str, index: int) -> None:
        shutil.rmtree(folder / "cache", ignore_errors=True)
        torch.manual_seed(index)

    try:
        timings = interleaved(
            {"plain": plain, "live": live}, rounds=rounds, warmup=warmup, before_each=before_each
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result: dict[str, Any] = {
        "size": size,
        "samples": samples,
        "batch_size": batch_size,
        "resolution": resolution,
        "rounds": rounds,
        "timings": timings.to_json(),
    }
    for clock in ("wall", "cpu"):
        result[clock] = {
            "median_seconds": {name: timings.spread(name, clock).median for name in VARIANTS},
            "live_over_plain": timings.ratio("live", "plain", clock).to_json(),
        }
    return result


def to_markdown(results: list[dict[str, Any]], threads: int) -> str:
    header = ["step", "samples (batch × px)", "clock", "plain epoch s", "live epoch s",
              "live / plain (target ≤ 1.05)"]  # fmt: skip
    rows = []
    for r in results:
        for clock in ("wall", "cpu"):
            c = r[clock]
            ratio = c["live_over_plain"]
            rows.append([
                r["size"], f"{r['samples']} ({r['batch_size']} × {r['resolution']})", clock,
                f"{c['median_seconds']['plain']:.3f}", f"{c['median_seconds']['live']:.3f}",
                f"{ratio['median']:.3f} ({ratio['q1']:.3f}–{ratio['q3']:.3f})",
            ])  # fmt: skip
    rounds = results[0]["rounds"] if results else 0
    return (
        f"Median (IQR) of same-round ratios over {rounds} rounds, {threads} torch thread(s); "
        "seconds are medians.\n\n" + markdown_table(header, rows, "lllrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_live_cache", __doc__), rounds=10)
    command.add_argument("--size", default="heavy_frozen", help="zoo SD size (the demo's)")
    command.add_argument("--samples", type=int, default=16, help="samples per epoch")
    args = command.parse_args(argv)
    if args.quick:
        options = {"size": "tiny", "samples": 4, "batch_size": 2, "resolution": 32}
        rounds, warmup = 2, 1
    else:
        options = {"size": args.size, "samples": args.samples, "batch_size": 4, "resolution": 128}
        rounds, warmup = args.rounds, 1
    with torch_threads(args.threads) as threads:
        results = [measure(**options, rounds=rounds, warmup=warmup)]
        where = environment("torch", "diffusers", torch_threads=True)
    payload = report("live_cache", results, where)
    write_results(args.out, "live_cache", payload, to_markdown(results, threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
