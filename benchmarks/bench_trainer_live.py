"""The Trainer's live first epoch (``split_trainer(..., cache_while_training=True)``) against a
plain ``Trainer`` epoch.

One round is one epoch of the tests' KD ``Trainer`` subclass (``tests/integrations/kd.py``: a
tiny random Llama student, a wider frozen Llama teacher called in ``compute_loss``, samples
padded to 10 tokens, AdamW) in two variants: ``plain`` is ``trainer.train()`` unsplit;
``live`` is ``trainer.train()`` after ``split_trainer(..., cache_while_training=True)`` into a
fresh folder: every batch runs stage 1 and stage 2 and hands its rows to the background writer,
and the epoch's end finishes the cache (the manifest, durable). Each variant's trainer (and the
split, traced once per trainer) is built untimed before its call; only ``train()`` is timed.
The variants alternate within each round (:func:`benchmarks.common.interleaved`), one torch
thread; the report gives the median and IQR of same-round ratios ``live / plain`` on
wall-clock and CPU time. The target is ``live / plain <= 1.05``.

    python -m benchmarks.bench_trainer_live --help
    python -m benchmarks.bench_trainer_live --quick --out /tmp/results     # smoke test
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

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


def build(folder: Path, *, samples: int, batch_size: int, student: int, teacher: int) -> Any:
    """A fresh KD trainer (the same seeds every time) training one epoch."""
    from transformers import TrainingArguments

    from tests.integrations.kd import DistillationTrainer, padded_samples, tiny_llama

    arguments = TrainingArguments(
        output_dir=str(folder / "out"),
        per_device_train_batch_size=batch_size,
        num_train_epochs=1,
        logging_steps=10**6,
        seed=7,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    return DistillationTrainer(
        model=tiny_llama(1, student),
        args=arguments,
        train_dataset=padded_samples(samples),
        teacher=tiny_llama(2, teacher),
    )


def measure(
    *, samples: int, batch_size: int, student: int, teacher: int, rounds: int, warmup: int
) -> dict[str, Any]:
    """Seconds per first epoch of both variants and their same-round ratio, on both clocks."""
    from graphsplit.integrations.transformers import split_trainer

    folder = Path(tempfile.mkdtemp(prefix="bench-trainer-live-"))
    trainers: dict[str, Any] = {}
    sizes = {"samples": samples, "batch_size": batch_size, "student": student, "teacher": teacher}

    def before_each(name: str, index: int) -> None:
        shutil.rmtree(folder / "cache", ignore_errors=True)
        shutil.rmtree(folder / "out", ignore_errors=True)
        trainer = build(folder, **sizes)
        if name == "live":
            split_trainer(trainer, str(folder / "cache"), cache_while_training=True)
        trainers[name] = trainer

    try:
        timings = interleaved(
            {name: (lambda name=name: trainers[name].train()) for name in VARIANTS},
            rounds=rounds,
            warmup=warmup,
            before_each=before_each,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result: dict[str, Any] = {**sizes, "rounds": rounds, "timings": timings.to_json()}
    for clock in ("wall", "cpu"):
        result[clock] = {
            "median_seconds": {name: timings.spread(name, clock).median for name in VARIANTS},
            "live_over_plain": timings.ratio("live", "plain", clock).to_json(),
        }
    return result


def to_markdown(results: list[dict[str, Any]], threads: int) -> str:
    header = ["student / teacher hidden", "samples (batch)", "clock", "plain epoch s",
              "live epoch s", "live / plain (target ≤ 1.05)"]  # fmt: skip
    rows = []
    for r in results:
        for clock in ("wall", "cpu"):
            c = r[clock]
            ratio = c["live_over_plain"]
            rows.append([
                f"{r['student']} / {r['teacher']}", f"{r['samples']} ({r['batch_size']})", clock,
                f"{c['median_seconds']['plain']:.3f}", f"{c['median_seconds']['live']:.3f}",
                f"{ratio['median']:.3f} ({ratio['q1']:.3f}–{ratio['q3']:.3f})",
            ])  # fmt: skip
    rounds = results[0]["rounds"] if results else 0
    return (
        f"Median (IQR) of same-round ratios over {rounds} rounds, {threads} torch thread(s); "
        "seconds are medians.\n\n" + markdown_table(header, rows, "lllrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_trainer_live", __doc__), rounds=10)
    command.add_argument("--samples", type=int, default=64, help="samples per epoch")
    command.add_argument("--student", type=int, default=64, help="student hidden size")
    command.add_argument("--teacher", type=int, default=256, help="teacher hidden size")
    args = command.parse_args(argv)
    if args.quick:
        options = {"samples": 8, "batch_size": 4, "student": 16, "teacher": 32}
        rounds, warmup = 2, 1
    else:
        options = {
            "samples": args.samples,
            "batch_size": 8,
            "student": args.student,
            "teacher": args.teacher,
        }
        rounds, warmup = args.rounds, 1
    with torch_threads(args.threads) as threads:
        results = [measure(**options, rounds=rounds, warmup=warmup)]
        where = environment("torch", "transformers", torch_threads=True)
    payload = report("trainer_live", results, where)
    write_results(args.out, "trainer_live", payload, to_markdown(results, threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
