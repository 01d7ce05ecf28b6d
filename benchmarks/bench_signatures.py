"""The cost of a new shape signature, and the bytes of one cache of several against one per shape.

For each case, a step and batches of two shapes:

- what a new shape costs: each round times ``graphsplit.split(step, example)`` (the first
  split: trace, analysis, cut, codegen); the first stage-1 batch of the second shape on a split
  of ``example`` made untimed just before (as ``cache()`` meets it: the dispatcher tries the
  plans and, when none fits, makes one); and a stage-1 batch of that shape on a split that has
  served it before. The new shape's cost is the difference of the last two; the figure is the
  median of the same-round ratios "new shape's cost / first split", with its IQR, on the wall
  clock and the CPU clock, beside the number of plans the new shape made (none where the first
  plan holds no size the shapes differ in, planning/tracing/int_calls.py). A plan made anew is
  compared with the plan of a split made from the second batch alone
  (:func:`benchmarks.bench_plan_scale.plan_digest`): what the planner reuses from the first
  plan must not change the plan.
- where the new plan goes (``--profile``): one more new plan, made as above on a fresh split,
  its node runs timed and each classed as met by the first plan (same target, arguments of
  the same shapes and values) or new to it (:mod:`benchmarks.signature_profile`); the share
  met is the most that reusing the first plan's work could save.
- bytes per sample: one ``cache()`` over the mixed loader (every signature in one folder, per
  row plan keys in the manifest) against one cache per signature (what the by-hand workflow
  kept), all files of the folders counted.

Cases: ``branch`` (the issue's size branch, tiny: ``if h.shape[-1] % 16 != 0``), ``flux``
(diffusers' FLUX full fine-tune, tiny: the unpacking's ``int(width)``, 32x32 against 32x48),
``wan`` (DiffSynth-Studio's own Wan 2.1 LoRA step, tiny: 5 against 9 frames; needs
``diffsynth``).

With ``--baseline`` (a git revision or a folder holding a graphsplit package), each case is
instead split in fresh child processes (``--child``), this graphsplit's and the baseline's in
``--rounds`` alternating pairs: the first ``split()`` of the process (where a step with an
int site, planning/tracing/int_calls.py, is traced a second time) and a second one (the site
known), as same-round ratios current / baseline.

    python -m benchmarks.bench_signatures --help
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Timings,
    baseline_code,
    environment,
    interleaved,
    markdown_table,
    parser,
    ratio_text,
    reply_to_parent,
    report,
    run_child,
    spread,
    timing_options,
    torch_threads,
    write_results,
)

Batch = dict[str, Any]
NEW = "new shape, first stage-1 batch"
AGAIN = "new shape, stage-1 batch again"
SPLITS = ("first", "again")  # --baseline: the first split of a fresh process, and a later one


def _branch() -> tuple[Any, Callable[[int, int], Batch], tuple[int, int]]:
    import torch

    from tests.signatures.test_dispatch import SizeBranch, _batch

    torch.manual_seed(0)
    return SizeBranch(), lambda shape, seed: _batch(shape, 2, seed), (16, 24)


def _flux() -> tuple[Any, Callable[[int, int], Batch], tuple[int, int]]:
    import torch

    from tests.conformance.matrix import ids_and_mask
    from tests.conformance.test_flux import FluxFineTuneStep
    from tests.signatures.test_real_shapes import VOCAB, _pixels

    torch.manual_seed(0)

    def batch(width: int, seed: int) -> Batch:
        return {
            "pixel_values": _pixels(2, 32, width, seed),
            "tokens_one": ids_and_mask(2, vocab=VOCAB, seed=seed)[0],
            "tokens_two": ids_and_mask(2, vocab=VOCAB, seed=seed + 50)[0],
        }

    # prompts: None, as the batches carry none (tests/signatures/test_real_shapes.py)
    return FluxFineTuneStep(sigmas_by_index=True), batch, (32, 48)


def _wan() -> tuple[Any, Callable[[int, int], Batch], tuple[int, int]]:
    import torch

    from examples.diffsynth.steps import wan_batch, wan_t2v_lora_step

    step, _ = wan_t2v_lora_step(seed=0)

    def batch(frames: int, seed: int) -> Batch:
        sample = wan_batch(seed)
        generator = torch.Generator().manual_seed(100 + seed)
        sample["video"] = torch.rand(1, 3, frames, 32, 32, generator=generator) * 2 - 1
        return sample

    return step, batch, (5, 9)


CASES = {"branch": _branch, "flux": _flux, "wan": _wan}


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _cache_bytes(split: Any, batches: list[Batch], folder: Path) -> int:
    import graphsplit

    keyed = [
        {
            **batch,
            "key": [f"{folder.name}-{i}-{row}" for row in range(len(batch[next(iter(batch))]))],
        }
        for i, batch in enumerate(batches)
    ]
    graphsplit.cache(split, keyed, folder, progress=False)
    return _folder_bytes(folder)


def measure(
    case: str, rounds: int, batches_per_shape: int, *, profile: bool = False
) -> dict[str, Any]:
    import torch

    import graphsplit
    from benchmarks.bench_plan_scale import plan_digest

    step, make_batch, shapes = CASES[case]()
    example, other = make_batch(shapes[0], 0), make_batch(shapes[1], 1)
    fresh: list[Any] = []
    known = graphsplit.split(step, kwargs=example)  # has served the new shape once already
    with torch.no_grad():
        known.stage1(**other)

    def new_split(name: str, _: int) -> None:  # untimed: a split that met the first shape only
        fresh[:] = [graphsplit.split(step, kwargs=example)] if name == NEW else []

    def first_batch_of_the_new_shape() -> None:
        with torch.no_grad():
            fresh[0].stage1(**other)  # a plan is made here if no plan fits

    def again() -> None:
        with torch.no_grad():
            known.stage1(**other)

    timings = interleaved(
        {
            "first split": lambda: graphsplit.split(step, kwargs=example),
            NEW: first_batch_of_the_new_shape,
            AGAIN: again,
        },
        rounds=rounds,
        before_each=new_split,
    )
    new_split(NEW, 0)
    first_batch_of_the_new_shape()
    split = fresh[0]
    plans_made = len(split.plans) - 1
    same_plan = None
    if plans_made:  # the plan the split's planner made anew is the one a split of that batch makes
        alone = graphsplit.split(step, kwargs=other).plans[0]
        same_plan = plan_digest(split.plans[1]) == plan_digest(alone)
    where = None
    if profile and plans_made:
        from benchmarks.signature_profile import new_plan_profile

        where = new_plan_profile(step, example, other)
    by_shape = {
        shape: [make_batch(shape, 10 + i) for i in range(batches_per_shape)] for shape in shapes
    }
    samples = sum(len(b[next(iter(b))]) for batches in by_shape.values() for b in batches)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        mixed_split = graphsplit.split(step, kwargs=example)
        mixed = [batch for pair in zip(*by_shape.values(), strict=True) for batch in pair]
        mixed_bytes = _cache_bytes(mixed_split, mixed, root / "mixed")
        single_bytes = 0
        for shape, batches in by_shape.items():
            single_split = graphsplit.split(step, kwargs=batches[0])
            single_bytes += _cache_bytes(single_split, batches, root / f"single-{shape}")
    return {
        "case": case,
        "shapes": list(shapes),
        "timings": timings.to_json(),
        "plans_made_for_the_new_shape": plans_made,
        "new_over_first": {
            clock: _cost_ratio(timings, clock).to_json() for clock in ("wall", "cpu")
        },
        "same_plan_as_its_own_split": same_plan,
        "new_plan_profile": where,
        "first_split_s": timings.spread("first split").to_json(),
        "new_signature_s": spread(_extra(timings, "wall")).to_json(),
        "samples": samples,
        "bytes_per_sample": {
            "one_mixed_cache": mixed_bytes / samples,
            "one_cache_per_shape": single_bytes / samples,
        },
    }


def _extra(timings: Any, clock: str) -> list[float]:
    """Per round: the new shape's first stage-1 batch less a stage-1 batch of that shape on a
    split that already knows it (what meeting the shape cost: a plan, or trying the plans)."""
    times = getattr(timings, clock)
    return [new - known for new, known in zip(times[NEW], times[AGAIN], strict=True)]


def _cost_ratio(timings: Any, clock: str) -> Any:
    """The same-round ratios "what the new shape cost / first split"."""
    firsts = getattr(timings, clock)["first split"]
    return spread(
        [extra / first for extra, first in zip(_extra(timings, clock), firsts, strict=True)]
    )


def to_markdown(results: list[dict[str, Any]]) -> str:
    def cell(value: dict[str, float], spec: str) -> str:
        return f"{value['median']:{spec}} (IQR {value['q1']:{spec}}–{value['q3']:{spec}})"

    header = [
        "case",
        "shapes",
        "first split, s",
        "plans made for the new shape",
        "new shape's cost, s",
        "new / first (wall)",
        "new / first (CPU)",
        "same plan as its own split",
        "bytes/sample, one mixed cache",
        "bytes/sample, a cache per shape",
    ]
    rows = [
        [
            r["case"],
            " vs ".join(map(str, r["shapes"])),
            cell(r["first_split_s"], ".2f"),
            str(r["plans_made_for_the_new_shape"]),
            cell(r["new_signature_s"], ".3f"),
            cell(r["new_over_first"]["wall"], ".2f"),
            cell(r["new_over_first"]["cpu"], ".2f"),
            {True: "yes", False: "**no**", None: "(no plan made)"}[r["same_plan_as_its_own_split"]],
            f"{r['bytes_per_sample']['one_mixed_cache']:,.0f}",
            f"{r['bytes_per_sample']['one_cache_per_shape']:,.0f}",
        ]
        for r in results
    ]
    table = markdown_table(header, rows, "llrrrrrlrr")
    profiled = [r for r in results if r.get("new_plan_profile")]
    if not profiled:
        return table
    from benchmarks.signature_profile import PARTS

    profile_rows = [
        [
            r["case"],
            f"{r['new_plan_profile']['plan_s']:.3f}",
            *(
                f"{r['new_plan_profile']['seconds'][part]:.3f} "
                f"({r['new_plan_profile']['seconds'][part] / r['new_plan_profile']['plan_s']:.0%})"
                for part in PARTS
            ),
        ]
        for r in profiled
    ]
    header = ["case", "new plan, s", *(f"{part}, s" for part in PARTS)]
    return table + "\n" + markdown_table(header, profile_rows, "lrrrr")


# -- the first split in a fresh process, against a baseline (children) ----------------------------
def _child(case: str, threads: int) -> None:
    """One fresh process: the step's first ``split()`` (where an int site is found and the
    trace made again), then a second (the site known): seconds on both clocks, plan digest."""
    import graphsplit
    from benchmarks.bench_plan_scale import plan_digest

    with torch_threads(threads):
        step, make_batch, shapes = CASES[case]()
        example = make_batch(shapes[0], 0)
        row: dict[str, Any] = {}
        for name in ("first", "again"):
            wall, cpu = time.perf_counter(), time.process_time()
            split = graphsplit.split(step, kwargs=example)
            row[name] = (time.perf_counter() - wall, time.process_time() - cpu)
        row["digest"] = plan_digest(split)
    reply_to_parent(row)


def versus(case: str, spec: str, rounds: int, threads: int) -> dict[str, Any]:
    """``rounds`` pairs of children, this graphsplit's and the baseline's, alternating which
    goes first: same-round ratios current / baseline of the first and the second split."""
    names = ("current", "baseline")
    timings = {split: Timings({n: [] for n in names}, {n: [] for n in names}) for split in SPLITS}
    digests: dict[str, set[str]] = {name: set() for name in names}
    with tempfile.TemporaryDirectory() as folder:
        where = {"current": None, "baseline": baseline_code(spec, Path(folder))}
        for index in range(rounds):
            for name in names if index % 2 == 0 else names[::-1]:
                argv = ["--child", case, "--threads", str(threads)]
                row = run_child("benchmarks.bench_signatures", argv, cwd=where[name])
                digests[name].add(row["digest"])
                for split in SPLITS:
                    timings[split].wall[name].append(row[split][0])
                    timings[split].cpu[name].append(row[split][1])
    return {
        "case": case,
        "baseline": spec,
        "rounds": rounds,
        "same_plan": len(digests["current"] | digests["baseline"]) == 1,
        **{
            split: {
                "current_s": timings[split].spread("current", "cpu").to_json(),
                "cpu_ratio": timings[split].ratio("current", "baseline", "cpu").to_json(),
                "wall_ratio": timings[split].ratio("current", "baseline", "wall").to_json(),
            }
            for split in SPLITS
        },
    }


def versus_markdown(rows: list[dict[str, Any]]) -> str:
    header = [
        "case",
        "same plan",
        "first split in the process, CPU s",
        "current / baseline (CPU)",
        "current / baseline (wall)",
        "a later split, CPU s",
        "current / baseline (CPU)",
    ]

    table = [
        [
            r["case"],
            "yes" if r["same_plan"] else "no",
            f"{r['first']['current_s']['median']:.2f}",
            ratio_text(r["first"]["cpu_ratio"]),
            ratio_text(r["first"]["wall_ratio"]),
            f"{r['again']['current_s']['median']:.2f}",
            ratio_text(r["again"]["cpu_ratio"]),
        ]
        for r in rows
    ]
    return markdown_table(header, table, "llrrrrr")


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_signatures", __doc__), rounds=5)
    command.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["flux", "wan"])
    command.add_argument("--batches", type=int, default=4, help="cached batches per shape")
    command.add_argument(
        "--profile", action="store_true", help="where one more new plan goes, by node run"
    )
    command.add_argument(
        "--baseline",
        metavar="REVISION_OR_FOLDER",
        help="time instead the first and a later split() of each case in fresh child processes, "
        "this graphsplit against another (a git revision, or a folder holding a graphsplit "
        "package), --rounds alternating pairs",
    )
    command.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = command.parse_args(argv)
    if args.child:
        _child(args.child, args.threads)
        return 0
    if args.baseline:
        rows = [versus(case, args.baseline, args.rounds, args.threads) for case in args.cases]
        payload = report("signatures_first_split", rows, environment("torch", "diffusers"))
        write_results(args.out, "signatures_first_split", payload, versus_markdown(rows))
        return 0
    rounds, batches = (1, 1) if args.quick else (args.rounds, args.batches)
    cases = ["branch"] if args.quick else args.cases
    with torch_threads(args.threads) as threads:
        results = [measure(case, rounds, batches, profile=args.profile) for case in cases]
    payload = report(
        "signatures",
        results,
        {**environment("torch", "diffusers", "transformers", "diffsynth"), "threads": threads},
    )
    write_results(args.out, "signatures", payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
