"""Stage 2's per-batch dispatch against the tiny demo step's stage-2 step, in one process.

``split.stage2`` is a dispatcher (:mod:`graphsplit.signatures.dispatch`): per batch it pops the
plan key a cached batch carries (``graphsplit_signature``), looks the plan up, checks the batch
against the plan's batch size and calls the plan's generated ``forward``. This measures that
work alone, against the training step it serves:

- dispatch: the time of ``split.stage2(**batch)`` (``nn.Module.__call__``, the stage's
  pre-hook refusing weights on ``meta``, the dispatcher) with the plan's generated ``forward``
  replaced by one that returns at once (the class attribute of the plan's own GraphModule
  class, put back after), per call, averaged over ``--calls`` calls;
- step: ``split.stage2(**batch)`` forward + backward on the tiny zoo SD LoRA step (the demo's
  step, ``tests.zoo.build_sd_lora_step(size="tiny")``) on its cached boundary tensors.

Each round times the step once and each dispatch case's block of calls once, the order
alternating between rounds; the figure is the median (IQR) of the same-round ratios
"dispatch per batch / step", on the wall clock and the CPU clock. The dispatch cases:

- ``one plan``: a batch that names no plan, one plan (the one-signature step, as ever);
- ``named plan``: the batch names its plan (what ``CachedDataset.loader`` batches carry once
  a cache holds several signatures), two plans known;
- ``tried in turn``: two plans known and a batch that names none: the plans are tried, the
  random generators' states saved before each (the fallback a hand-made batch meets).

``--meta-check`` also times the stage's meta check alone on an SD-1.5-shaped LoRA UNet
(diffusers' ``UNet2DConditionModel`` with SD 1.5's block structure at widths 32-128, peft LoRA
on the attention projections: the module and tensor counts of the real one): the hook every
stage call runs (``MetaTensorCheck``) against the walk of ``named_parameters()`` and
``named_buffers()`` it replaced (``_refuse_meta_tensors``, now run only to name a refused
tensor), ``--calls`` calls of each per round, interleaved.

    python -m benchmarks.bench_dispatch --help
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
    report,
    timing_options,
    torch_threads,
    write_results,
)

CASES = ("one plan", "named plan", "tried in turn")


@contextlib.contextmanager
def _forward_returns_at_once(stage: Any) -> Iterator[None]:
    """The stage's generated ``forward`` (its own class's) returns None while inside."""
    kind = type(stage)
    generated = kind.__dict__["forward"]
    kind.forward = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        kind.forward = generated


def _second_plan_known(split: Any) -> str:
    """Make the split's dispatcher know a second plan, recorded by a cache (as ``cache()``
    leaves it after a batch of another signature); returns the first plan's key."""
    from graphsplit.signatures.signature import Signature

    other = Signature((("x.shape[-1]", "7"),))
    split.plan_set.know(other.key, other.to_json(), None)
    return split.plans[0].key


def measure(rounds: int, calls: int) -> dict[str, Any]:
    import torch

    import graphsplit
    from benchmarks.hand_written import example_batch
    from graphsplit.signatures.signature import SIGNATURE_KEY
    from tests.zoo import build_sd_lora_step

    step = build_sd_lora_step(seed=0, size="tiny")
    pixels, ids = example_batch("tiny")
    split = graphsplit.split(step, (pixels, ids))
    with torch.no_grad():
        boundary = split.stage1(pixels, ids)
    one_plan = graphsplit.split(step, (pixels, ids))  # a split that knows one plan only
    key = _second_plan_known(split)
    named = {**boundary, SIGNATURE_KEY: key}
    # Every case dispatches to the same generated code: the same loss, bit for bit.
    losses = []
    for stage, batch in (
        (one_plan.stage2, boundary),
        (split.stage2, named),
        (split.stage2, boundary),
    ):
        torch.manual_seed(0)
        losses.append(stage(**batch))
    assert all(torch.equal(loss, losses[0]) for loss in losses), "the dispatch changed the loss"

    def dispatch(stage: Any, batch: dict[str, Any]) -> Callable[[], None]:
        def run() -> None:
            with _forward_returns_at_once(stage):
                for _ in range(calls):
                    stage(**batch)  # as training calls it: the module's hooks run too

        return run

    def train_step() -> None:
        split.stage2(**named).backward()

    variants = {
        "step": train_step,
        "one plan": dispatch(one_plan.stage2, boundary),
        "named plan": dispatch(split.stage2, named),
        "tried in turn": dispatch(split.stage2, boundary),
    }

    def before_each(name: str, index: int) -> None:
        for param in step.parameters():
            param.grad = None
        torch.manual_seed(index)

    timings = interleaved(variants, rounds=rounds, warmup=2, before_each=before_each)
    per_batch = {
        clock: {
            case: _scaled(timings.ratio(case, "step", clock).to_json(), 1 / calls) for case in CASES
        }
        for clock in ("wall", "cpu")
    }
    seconds = {case: _scaled(timings.spread(case, "wall").to_json(), 1 / calls) for case in CASES}
    return {
        "calls_per_round": calls,
        "rounds": rounds,
        "step_s": timings.spread("step", "wall").to_json(),
        "step_cpu_s": timings.spread("step", "cpu").to_json(),
        "dispatch_s": seconds,
        "dispatch_over_step": per_batch,
        "timings": timings.to_json(),
    }


def meta_check(rounds: int, calls: int) -> dict[str, Any]:
    """Seconds per call of the meta check and of the walk it replaced, on the UNet above."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from graphsplit.planning.codegen.stages import MetaTensorCheck, _refuse_meta_tensors

    unet = UNet2DConditionModel(
        block_out_channels=(32, 64, 128, 128),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
        sample_size=8,
    ).requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    check = MetaTensorCheck()

    def repeated(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                call()

        return run

    timings = interleaved(
        {
            "gathered dicts": repeated(lambda: check(unet, ())),
            "walk": repeated(lambda: _refuse_meta_tensors(unet)),
        },
        rounds=rounds,
    )
    return {
        "tensors": sum(1 for _ in unet.parameters()) + sum(1 for _ in unet.buffers()),
        "modules": sum(1 for _ in unet.modules()),
        "seconds_per_call": {
            name: _scaled(timings.spread(name, "cpu").to_json(), 1 / calls)
            for name in ("gathered dicts", "walk")
        },
    }


def _scaled(value: dict[str, float], factor: float) -> dict[str, float]:
    return {name: (v * factor if name != "count" else v) for name, v in value.items()}


def to_markdown(result: dict[str, Any]) -> str:
    def cell(value: dict[str, float], scale: float, spec: str) -> str:
        median, q1, q3 = (value[k] * scale for k in ("median", "q1", "q3"))
        return f"{median:{spec}} (IQR {q1:{spec}}–{q3:{spec}})"

    header = ["dispatch case", "per batch, µs", "/ step (wall), %", "/ step (CPU), %"]
    rows = [
        [
            case,
            cell(result["dispatch_s"][case], 1e6, ".1f"),
            cell(result["dispatch_over_step"]["wall"][case], 100, ".4f"),
            cell(result["dispatch_over_step"]["cpu"][case], 100, ".4f"),
        ]
        for case in CASES
    ]
    step = result["step_s"]
    text = (
        f"stage-2 step (forward + backward): {step['median'] * 1e3:.1f} ms "
        f"(IQR {step['q1'] * 1e3:.1f}–{step['q3'] * 1e3:.1f})\n\n"
        + markdown_table(header, rows, "lrrr")
    )
    check = result.get("meta_check")
    if check is not None:
        text += (
            f"\n\nThe meta check on an SD-1.5-shaped LoRA UNet ({check['tensors']} tensors in "
            f"{check['modules']} modules), CPU µs a call\n\n"
            + markdown_table(
                ["check", "µs a call"],
                [
                    [name, cell(value, 1e6, ".1f")]
                    for name, value in check["seconds_per_call"].items()
                ],
                "lr",
            )
        )
    return text


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_dispatch", __doc__), rounds=15)
    command.add_argument(
        "--calls", type=int, default=200, help="dispatches timed per round (default: 200)"
    )
    command.add_argument(
        "--meta-check",
        action="store_true",
        help="also time the stage's meta check on an SD-1.5-shaped LoRA UNet",
    )
    args = command.parse_args(argv)
    rounds, calls = (1, 20) if args.quick else (args.rounds, args.calls)
    with torch_threads(args.threads) as threads:
        result = measure(rounds, calls)
        if args.meta_check:
            result["meta_check"] = meta_check(rounds, max(1, calls // 4))
    payload = report(
        "dispatch",
        result,
        {**environment("torch", "diffusers", "transformers"), "threads": threads},
    )
    write_results(args.out, "dispatch", payload, to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
