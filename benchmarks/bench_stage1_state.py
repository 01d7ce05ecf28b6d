"""What putting back the step's module state costs the module-level path's stage 1.

Stage 1 of the module-level path stops the user's step at its last cached call; since it must
not leave behind what the step changed in its modules for a while (Diffusion-DPO's
``disable_adapters()`` around the reference call), it takes every module's state before the
step and puts it back after (:mod:`graphsplit.calls.stopped_step`: the module writes of the
running thread are followed, each parameter's ``requires_grad`` kept). Two figures:

- ``stage 1``: the zoo's SD-1.5 LoRA step split with ``path="calls"``, its ``stage1`` on the
  same raw batch with the snapshot and with it replaced by one that takes nothing, interleaved
  (``--rounds`` rounds of ``--calls`` calls each); the figure is the median (IQR) of the
  same-round ratios "with / without", on the wall and the CPU clock. Before timing, both
  variants are checked to give the same stage-1 outputs bit for bit.
- ``snapshot``: ``ModuleState.of(parameters).put_back()`` alone (nothing written between),
  CPU time a call, on full-size models built on ``meta`` (``benchmarks.bench_plan_scale``'s
  SDXL and FLUX steps: its cost is the parameter count's, whatever the weights).

    python -m benchmarks.bench_stage1_state --rounds 15 --out benchmarks/results
    python -m benchmarks.bench_stage1_state --quick --out /tmp/results
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    ratio_text,
    report,
    timing_options,
    torch_threads,
    write_results,
)


class _TakesNothing:
    """A ``ModuleState`` that takes and puts back nothing: stage 1 as it was before."""

    @classmethod
    def of(cls, root: Any) -> _TakesNothing:
        return cls()

    def put_back(self) -> None:
        pass


@contextlib.contextmanager
def _without_snapshot() -> Iterator[None]:
    from graphsplit.calls import stages

    kept = stages.ModuleState
    stages.ModuleState = _TakesNothing  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        stages.ModuleState = kept  # type: ignore[misc]


def measure_stage1(rounds: int, calls: int) -> dict[str, Any]:
    import torch

    import graphsplit
    from benchmarks.hand_written import example_batch
    from tests.zoo import build_sd_lora_step

    step = build_sd_lora_step(seed=0, size="tiny")
    pixels, ids = example_batch("tiny")
    split = graphsplit.split(step, (pixels, ids), path="calls")
    with _without_snapshot():
        before = split.stage1(pixels, ids)
    after = split.stage1(pixels, ids)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before), "the outputs changed"

    def repeated(call: Callable[[], Any], snapshot: bool) -> Callable[[], None]:
        def run() -> None:
            with contextlib.nullcontext() if snapshot else _without_snapshot():
                for _ in range(calls):
                    call()

        return run

    def stage1() -> Any:
        return split.stage1(pixels, ids)

    timings = interleaved(
        {"with": repeated(stage1, True), "without": repeated(stage1, False)},
        rounds=rounds,
        warmup=1,
    )
    return {
        "calls_per_round": calls,
        "rounds": rounds,
        "modules": sum(1 for _ in split.stage1._step.modules()),
        "stage1_s": timings.spread("without", "wall").to_json(),
        "ratio": {
            clock: timings.ratio("with", "without", clock).to_json() for clock in ("wall", "cpu")
        },
        "timings": timings.to_json(),
    }


def measure_snapshot(cases: list[str], calls: int) -> list[dict[str, Any]]:
    import time

    from benchmarks.bench_plan_scale import BUILDERS
    from graphsplit.calls.stopped_step import ModuleState

    rows = []
    for case in cases:
        model, _args = BUILDERS[case](1)
        parameters = list(model.parameters())  # listed once, as a stage lists them
        seconds = []
        for _ in range(calls):
            start = time.process_time()
            ModuleState.of(parameters).put_back()
            seconds.append(time.process_time() - start)
        seconds.sort()
        rows.append(
            {
                "case": case,
                "modules": sum(1 for _ in model.modules()),
                "parameters": sum(1 for _ in model.parameters()),
                "cpu_s_median": seconds[len(seconds) // 2],
                "cpu_s_min": seconds[0],
                "cpu_s_max": seconds[-1],
            }
        )
    return rows


def to_markdown(result: dict[str, Any]) -> str:
    stage1 = result["stage1"]
    step = stage1["stage1_s"]
    text = (
        f"SD-1.5 LoRA (zoo, tiny), module-level stage 1 without the snapshot: "
        f"{step['median'] / stage1['calls_per_round'] * 1e3:.2f} ms a call "
        f"({stage1['modules']} modules)\n\n"
        + markdown_table(
            ["stage 1 with / without the snapshot", "wall", "CPU"],
            [["ratio", ratio_text(stage1["ratio"]["wall"]), ratio_text(stage1["ratio"]["cpu"])]],
            "lrr",
        )
    )
    rows = [
        [
            row["case"],
            str(row["modules"]),
            str(row["parameters"]),
            f"{row['cpu_s_median'] * 1e3:.2f} ({row['cpu_s_min'] * 1e3:.2f}–"
            f"{row['cpu_s_max'] * 1e3:.2f})",
        ]
        for row in result["snapshot"]
    ]
    text += "\n\n" + markdown_table(
        ["full-size step on meta", "modules", "parameters", "snapshot + put back, CPU ms"],
        rows,
        "lrrr",
    )
    return text


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_stage1_state", __doc__), rounds=15)
    command.add_argument("--calls", type=int, default=20, help="stage-1 calls per round")
    command.add_argument(
        "--cases", nargs="*", default=["sdxl", "flux"], help="full-size steps for the snapshot"
    )
    args = command.parse_args(argv)
    rounds, calls = (1, 2) if args.quick else (args.rounds, args.calls)
    cases = ["tiny"] if args.quick else args.cases
    with torch_threads(args.threads) as threads:
        result = {
            "stage1": measure_stage1(rounds, calls),
            "snapshot": measure_snapshot(cases, 3 if args.quick else 20),
        }
    payload = report(
        "stage1_state",
        result,
        {**environment("torch", "diffusers", "transformers"), "threads": threads},
    )
    write_results(args.out, "stage1_state", payload, to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
