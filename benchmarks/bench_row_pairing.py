"""What finding rows paired by position costs, against the ``split()`` it belongs to.

``split.paired_rows`` is found on first read (``cache()``, ``report()``, ``to_json()``), not by
``split()``: :func:`graphsplit.row_pairing.find_paired_rows` runs stage 1 once and stage 2
``rows + 2`` times on the example (``rows + 2`` more per swap where rows meet, two at most),
under a dispatch mode that records which parts of each op's output hold a NaN. Each round times
``graphsplit.split(step, example)`` alone and followed by reading ``paired_rows``, in
alternating order; the figure is the median of the same-round ratios "split and paired_rows /
split", with its IQR, on the wall clock and the CPU clock. A ``split()`` that is never cached
nor reported pays nothing.

Cases: ``sd`` (the zoo's tiny SD-1.5 LoRA step at 4 images: rows never meet), ``kd`` (the Llama
knowledge-distillation step at 4 rows: rows never meet), ``dpo`` (TRL's LoRA DPO
``compute_loss`` at 4 pairs, 8 rows ``[chosen; rejected]``: rows meet, the module-level path).

    python -m benchmarks.bench_row_pairing --help
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
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

# A case: the step, the example's positional and keyword arguments.
Case = tuple[Any, tuple[Any, ...], dict[str, Any]]


def _sd() -> Case:
    import torch

    from tests.zoo import SD_SIZES, CaptionedImages
    from tests.zoo.sd import build_sd_lora_step

    step = build_sd_lora_step(size="tiny")
    data = CaptionedImages(length=4, resolution=SD_SIZES["tiny"].resolution)
    items = [data[i] for i in range(4)]
    pixels = torch.stack([item["pixel_values"] for item in items])
    return step, (pixels, torch.stack([item["input_ids"] for item in items])), {}


def _kd() -> Case:
    import torch

    from benchmarks.bench_calls_overhead import KD_HIDDEN, _kd_step
    from tests.integrations.kd import padded_samples

    step = _kd_step(KD_HIDDEN["tiny"])
    samples = padded_samples(4)
    return step, (), {name: torch.stack([s[name] for s in samples]) for name in samples[0]}


def _dpo() -> Case:
    from graphsplit.integrations.transformers import TrainerLoss
    from tests.conformance.test_unseen15_trl_dpo_lora_null_reference import (
        _batches,
        make_trainer,
    )

    trainer = make_trainer(tempfile.mkdtemp(prefix="bench-row-pairing-"))
    return TrainerLoss(trainer), (_batches(trainer)[0],), {}


CASES: dict[str, Callable[[], Case]] = {
    "sd": _sd,
    "kd": _kd,
    "dpo": _dpo,
}


def measure(case: str, rounds: int) -> dict[str, Any]:
    import graphsplit

    step, args, kwargs = CASES[case]()

    def with_pairing() -> Any:
        split = graphsplit.split(step, args, kwargs)
        return split.paired_rows

    timings = interleaved(
        {"split": lambda: graphsplit.split(step, args, kwargs), "and paired_rows": with_pairing},
        rounds=rounds,
    )
    split = graphsplit.split(step, args, kwargs)
    return {
        "case": case,
        "path": split.path,
        "paired_rows": None if split.paired_rows is None else split.paired_rows.to_json(),
        "timings": timings.to_json(),
        "split_s": timings.spread("split").to_json(),
        "with_pairing_s": timings.spread("and paired_rows").to_json(),
        "with_over_split": {
            clock: timings.ratio("and paired_rows", "split", clock).to_json()
            for clock in ("wall", "cpu")
        },
    }


def to_markdown(results: list[dict[str, Any]]) -> str:
    def cell(value: dict[str, float], spec: str) -> str:
        return f"{value['median']:{spec}} (IQR {value['q1']:{spec}}–{value['q3']:{spec}})"

    header = [
        "case",
        "path",
        "rows meet",
        "split, s",
        "split and paired_rows, s",
        "with / split (wall)",
        "with / split (CPU)",
    ]
    rows = [
        [
            r["case"],
            r["path"],
            "yes" if r["paired_rows"] else "no",
            cell(r["split_s"], ".2f"),
            cell(r["with_pairing_s"], ".2f"),
            cell(r["with_over_split"]["wall"], ".2f"),
            cell(r["with_over_split"]["cpu"], ".2f"),
        ]
        for r in results
    ]
    return markdown_table(header, rows, "lllrrrr")


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_row_pairing", __doc__), rounds=5)
    command.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    args = command.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    cases = ["kd"] if args.quick else args.cases
    with torch_threads(args.threads) as threads:
        results = [measure(case, rounds) for case in cases]
    payload = report(
        "row_pairing",
        results,
        {**environment("torch", "diffusers", "transformers", "trl"), "threads": threads},
    )
    write_results(args.out, "row_pairing", payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
