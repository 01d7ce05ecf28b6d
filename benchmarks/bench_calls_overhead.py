"""The module-level path's cost: stage 2 against the step written by hand, stage 1 and cache
bytes against the traced path, on the same step.

For each case, one step split twice, ``path="calls"`` and ``path="trace"``:

- stage-2 overhead: each round runs one training step (forward and backward, the generators
  seeded alike) of the calls path's ``stage2`` on a batch read back from its cache
  (``CachedDataset`` and ``collate``, as a training loop reads it), and of the step the user
  writes by hand with the frozen calls removed (the denoiser on the cached latent parameters and
  text embedding; the student on the cached teacher logits), in alternating order. The figure
  is the median of the same-round ratios "calls stage 2 / by hand", with its IQR, on the wall
  and the CPU clock (target: <= 1.02). The traced path's stage 2 against the same hand step is
  beside it.
- stage-1 time: ``stage1`` of each path on the same raw batch, interleaved, as the ratio
  "calls / traced".
- cache bytes per sample: one ``cache()`` of each path over the same batches, every file of the
  folder counted.

Cases: ``sd`` (the zoo's SD-1.5 LoRA step: frozen VAE and CLIP text encoder, a LoRA UNet),
``kd`` (knowledge distillation: a frozen Llama teacher called with the labels too, as the
trainer example calls it, a trainable Llama student, the loss half cross-entropy half KL; the
module-level path caches the teacher's ``.logits``, which the step reads, and leaves out its
scalar ``.loss`` and its ``DynamicCache``).
``kd-wide`` (the same KD step with 512-wide Llamas: a student step of about 10 ms on one
thread, beside the tiny one's 1.1 ms). On KD the hand step reads the very tensors the calls
path's stage 2 reads (its cached batch's inputs and ``teacher__0__logits``), and a fourth
variant, "free call", runs the user's step with the teacher's call answered by an output built
beforehand: the floor of any stage 2 that keeps the user's code (its teacher call, its
``no_grad`` block, the step module's own call), and a fifth, "user's module by hand", is the
user's ``KDStep`` module itself with the teacher's call (and its ``no_grad`` block) removed by
hand, the logits passed in: issue 27's "the user's step with the frozen calls removed by hand"
read literally, beside the plain-function hand step. ``--size`` picks the zoo size of sd and kd.

    python -m benchmarks.bench_calls_overhead --help
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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

Batch = dict[str, Any]


@dataclass
class Case:
    """A step, its batches and the hand-written stage 2 on a cached batch of either path.

    ``by_hand(batch, frozen)`` returns the loss of the step with the frozen calls removed.
    With ``from_cache`` (KD), ``batch`` and ``frozen`` are read from the very batch the calls
    path's stage 2 gets from its cache (``from_cache(cached_batch) -> (batch, frozen)``), so
    both run on the same tensors; without (SD, whose calls boundary holds no text embedding),
    ``frozen(batch)`` computes them from the raw batch once, untimed. ``free_call(batch,
    frozen)``, when given, makes a call that runs the user's step with its frozen call answered
    by an output built beforehand (the step with a free cache: the floor of any stage 2).
    """

    step: Any
    batches: list[Batch]
    frozen: Callable[[Batch], dict[str, Any]]
    by_hand: Callable[[Batch, dict[str, Any]], Any]
    from_cache: Callable[[Batch], tuple[Batch, dict[str, Any]]] | None = None
    free_call: Callable[[Batch, dict[str, Any]], Callable[[], Any]] | None = None
    module_by_hand: Callable[[Batch, dict[str, Any]], Callable[[], Any]] | None = None


# -- SD-1.5 LoRA ------------------------------------------------------------------------------
def _sd(size: str, count: int) -> Case:
    import torch

    from benchmarks.hand_written import denoising_loss, frozen_outputs
    from tests.zoo import SD_SIZES, CaptionedImages
    from tests.zoo.sd import build_sd_lora_step

    step = build_sd_lora_step(size=size)
    batch_size = SD_SIZES[size].batch_size
    dataset = CaptionedImages(length=batch_size * count, resolution=SD_SIZES[size].resolution)
    batches = []
    for first in range(0, batch_size * count, batch_size):
        items = [dataset[i] for i in range(first, first + batch_size)]
        batches.append(
            {
                "pixel_values": torch.stack([item["pixel_values"] for item in items]),
                "input_ids": torch.stack([item["input_ids"] for item in items]),
            }
        )
    scaling = step.vae.config.scaling_factor
    return Case(
        step,
        batches,
        lambda batch: frozen_outputs(step, batch["pixel_values"], batch["input_ids"]),
        lambda batch, frozen: denoising_loss(
            step.unet,
            step.scheduler,
            frozen["latent_parameters"],
            frozen["text_embedding"],
            scaling_factor=scaling,
        ),
    )


# -- knowledge distillation -------------------------------------------------------------------
def _kd_step(hidden: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from tests.integrations.kd import tiny_llama

    def distillation_loss(student_output: Any, teacher_logits: Any) -> Any:
        distill = F.kl_div(
            F.log_softmax(student_output.logits, dim=-1),
            F.log_softmax(teacher_logits, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        return 0.5 * student_output.loss + 0.5 * distill

    class KDStep(nn.Module):
        """The user's distillation step: the teacher called as the trainer example calls it."""

        def __init__(self) -> None:
            super().__init__()
            self.student = tiny_llama(0, hidden).train()
            self.teacher = tiny_llama(1, hidden).eval().requires_grad_(False)

        def forward(self, input_ids: Any, attention_mask: Any, labels: Any) -> Any:
            with torch.no_grad():
                # As the trainer example calls it: labels given (a scalar .loss) and the
                # cache on (a DynamicCache); the module-level path caches the .logits read.
                teacher_logits = self.teacher(
                    input_ids=input_ids, attention_mask=attention_mask, labels=labels
                ).logits
            student = self.student(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels
            )
            return distillation_loss(student, teacher_logits)

    class KDStepByHand(nn.Module):
        """``KDStep`` with the teacher's call removed by hand, as its user would edit it: the
        ``no_grad`` block and the call go, the logits come in as an argument."""

        def __init__(self, student: nn.Module) -> None:
            super().__init__()
            self.student = student

        def forward(
            self, input_ids: Any, attention_mask: Any, labels: Any, teacher_logits: Any
        ) -> Any:
            student = self.student(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels
            )
            return distillation_loss(student, teacher_logits)

    step = KDStep()
    step.distillation_loss = distillation_loss  # the by-hand step shares the loss
    # Not a submodule of the step: it shares the student and must not be split with it.
    object.__setattr__(step, "by_hand_module", KDStepByHand(step.student))
    return step


KD_HIDDEN = {"tiny": 32, "small": 128}
WIDE_HIDDEN = 512
"""``kd-wide``: the KD step with 512-wide Llamas, a student step of about 10 ms on one thread."""


def _kd(size: str, count: int, hidden: int | None = None) -> Case:
    import torch

    from tests.integrations.kd import padded_samples

    step = _kd_step(hidden or KD_HIDDEN[size])
    samples = padded_samples(4 * count)
    batches = [
        {name: torch.stack([s[name] for s in samples[i : i + 4]]) for name in samples[0]}
        for i in range(0, 4 * count, 4)
    ]

    def frozen(batch: Batch) -> dict[str, Any]:
        with torch.no_grad():
            teacher = step.teacher(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            )
            return {"teacher_logits": teacher.logits}

    def by_hand(batch: Batch, cached: dict[str, Any]) -> Any:
        student = step.student(**batch)
        return step.distillation_loss(student, cached["teacher_logits"])

    inputs = ("input_ids", "attention_mask", "labels")

    def from_cache(cached: Batch) -> tuple[Batch, dict[str, Any]]:
        return {name: cached[name] for name in inputs}, {
            "teacher_logits": cached["teacher__0__logits"]
        }

    def free_call(batch: Batch, cached: dict[str, Any]) -> Callable[[], Any]:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        output = CausalLMOutputWithPast(logits=cached["teacher_logits"])  # built once

        def run() -> Any:
            step.teacher.__dict__["forward"] = lambda *args, **kwargs: output
            try:
                return step(**batch)
            finally:
                del step.teacher.__dict__["forward"]

        return run

    def module_by_hand(batch: Batch, cached: dict[str, Any]) -> Callable[[], Any]:
        module = step.by_hand_module
        logits = cached["teacher_logits"]
        return lambda: module(**batch, teacher_logits=logits)

    return Case(step, batches, frozen, by_hand, from_cache, free_call, module_by_hand)


def _kd_wide(size: str, count: int) -> Case:
    return _kd(size, count, WIDE_HIDDEN)


CASES = {"sd": _sd, "kd": _kd, "kd-wide": _kd_wide}


# -- measuring --------------------------------------------------------------------------------
def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _cache_bytes(split: Any, batches: list[Batch], folder: Path) -> tuple[int, int]:
    import graphsplit

    keyed = []
    for index, batch in enumerate(batches):
        rows = len(next(iter(batch.values())))
        keyed.append({**batch, "key": [f"{index}-{row}" for row in range(rows)]})
    graphsplit.cache(split, keyed, folder, progress=False)
    return _folder_bytes(folder), sum(len(batch["key"]) for batch in keyed)


def _cached_batch(split: Any, folder: Path, rows: int) -> Batch:
    """The first ``rows`` samples of a cache, as training reads them (``CachedDataset``,
    ``collate``): what stage 2 gets in a real loop."""
    from graphsplit import CachedDataset, collate

    dataset = CachedDataset(folder, split)
    return collate([dataset[index] for index in range(rows)])


def measure(
    case_name: str,
    size: str,
    rounds: int,
    batches: int,
    recompute: str = "never",
    steps: int = 1,
) -> dict[str, Any]:
    import torch

    import graphsplit

    case = CASES[case_name](size, batches)
    example = case.batches[0]
    rows = len(next(iter(example.values())))
    calls = graphsplit.split(case.step, kwargs=example, path="calls", recompute=recompute)
    traced = graphsplit.split(case.step, kwargs=example, path="trace", recompute=recompute)
    parameters = [p for p in case.step.parameters() if p.requires_grad]
    with tempfile.TemporaryDirectory() as folder:
        # Both stage 2s train on a batch read back from their own cache, as in a real loop.
        calls_bytes, samples = _cache_bytes(calls, case.batches, Path(folder) / "calls")
        traced_bytes, _ = _cache_bytes(traced, case.batches, Path(folder) / "traced")
        calls_boundary = _cached_batch(calls, Path(folder) / "calls", rows)
        traced_boundary = _cached_batch(traced, Path(folder) / "traced", rows)
        if case.from_cache is not None:  # the hand step on the calls path's very tensors
            hand_batch, frozen = case.from_cache(calls_boundary)
        else:
            hand_batch, frozen = example, case.frozen(example)

        def train(loss: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                for _ in range(steps):
                    # The CPU generator alone: torch.manual_seed also queues CUDA / XPU / MTIA
                    # seeds, each capturing a stack trace (0.3 ms a call), the same in every
                    # variant.
                    torch.default_generator.manual_seed(0)
                    loss().backward()
                    for param in parameters:  # as the optimizer's zero_grad, in every variant
                        param.grad = None

            return run

        def reset(name: str, index: int) -> None:
            for param in parameters:
                param.grad = None

        variants = {
            "by hand": lambda: case.by_hand(hand_batch, frozen),
            "calls stage 2": lambda: calls.stage2(**calls_boundary),
            "traced stage 2": lambda: traced.stage2(**traced_boundary),
        }
        if case.free_call is not None:
            variants["free call"] = case.free_call(hand_batch, frozen)
        if case.module_by_hand is not None:
            variants["user's module by hand"] = case.module_by_hand(hand_batch, frozen)
        # The same seed and the same cached values: the losses must agree before timing.
        losses = {}
        for name, variant in variants.items():
            torch.manual_seed(0)
            losses[name] = variant()
        hand_loss = losses["by hand"]
        agree = {
            name.split()[0]: bool(torch.allclose(loss, hand_loss, rtol=1e-5, atol=1e-6))
            for name, loss in losses.items()
            if name != "by hand"
        }
        stage2 = interleaved(
            {name: train(variant) for name, variant in variants.items()},
            rounds=rounds,
            before_each=reset,
        )
        stage1 = interleaved(
            {
                "calls stage 1": lambda: calls.stage1(**example),
                "traced stage 1": lambda: traced.stage1(**example),
            },
            rounds=rounds,
        )
    result = {
        "case": case_name,
        "size": size,
        "losses_agree_with_hand": agree,
        "calls_keys": sorted(calls_boundary),
        "traced_keys": sorted(traced_boundary),
        "stage2": stage2.to_json(),
        "stage1": stage1.to_json(),
        "calls_over_hand": {
            clock: stage2.ratio("calls stage 2", "by hand", clock).to_json()
            for clock in ("wall", "cpu")
        },
        "traced_over_hand": {
            clock: stage2.ratio("traced stage 2", "by hand", clock).to_json()
            for clock in ("wall", "cpu")
        },
        "hand_step_s": stage2.spread("by hand", "cpu").to_json(),
        "stage1_calls_over_traced": {
            clock: stage1.ratio("calls stage 1", "traced stage 1", clock).to_json()
            for clock in ("wall", "cpu")
        },
        "stage1_traced_s": stage1.spread("traced stage 1", "cpu").to_json(),
        "samples": samples,
        "bytes_per_sample": {"calls": calls_bytes / samples, "traced": traced_bytes / samples},
        "recompute": recompute,
        "steps_per_call": steps,
    }
    if case.free_call is not None:
        result["free_call_over_hand"] = {
            clock: stage2.ratio("free call", "by hand", clock).to_json()
            for clock in ("wall", "cpu")
        }
        result["calls_over_free_call"] = {
            clock: stage2.ratio("calls stage 2", "free call", clock).to_json()
            for clock in ("wall", "cpu")
        }
    if case.module_by_hand is not None:
        result["calls_over_module_by_hand"] = {
            clock: stage2.ratio("calls stage 2", "user's module by hand", clock).to_json()
            for clock in ("wall", "cpu")
        }
    return result


def to_markdown(results: list[dict[str, Any]]) -> str:
    header = [
        "case",
        "hand step, CPU ms",
        "calls stage 2 / by hand (CPU)",
        "calls stage 2 / by hand (wall)",
        "traced stage 2 / by hand (CPU)",
        "free call / by hand (CPU)",
        "calls stage 2 / free call (CPU)",
        "calls stage 2 / user's module by hand (CPU)",
        "calls stage 2 / user's module by hand (wall)",
        "stage 1 calls / traced (CPU)",
        "stage 1 calls / traced (wall)",
        "bytes/sample calls",
        "bytes/sample traced",
    ]
    rows = [
        [
            f"{r['case']} ({r['size']})"
            + (f", recompute={r['recompute']}" if r.get("recompute", "never") != "never" else "")
            + (f", {r['steps_per_call']} steps a call" if r.get("steps_per_call", 1) > 1 else ""),
            f"{r['hand_step_s']['median'] * 1e3 / r.get('steps_per_call', 1):.1f}",
            ratio_text(r["calls_over_hand"]["cpu"]),
            ratio_text(r["calls_over_hand"]["wall"]),
            ratio_text(r["traced_over_hand"]["cpu"]),
            ratio_text(r["free_call_over_hand"]["cpu"]) if "free_call_over_hand" in r else "-",
            ratio_text(r["calls_over_free_call"]["cpu"]) if "calls_over_free_call" in r else "-",
            *(
                ratio_text(r["calls_over_module_by_hand"][clock])
                if "calls_over_module_by_hand" in r
                else "-"
                for clock in ("cpu", "wall")
            ),
            ratio_text(r["stage1_calls_over_traced"]["cpu"]),
            ratio_text(r["stage1_calls_over_traced"]["wall"]),
            f"{r['bytes_per_sample']['calls']:,.0f}",
            f"{r['bytes_per_sample']['traced']:,.0f}",
        ]
        for r in results
    ]
    return markdown_table(header, rows, "l" + "r" * (len(header) - 1))


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_calls_overhead", __doc__), rounds=30)
    command.add_argument(
        "--cases", nargs="+", choices=sorted(CASES), default=["sd", "kd", "kd-wide"]
    )
    command.add_argument("--size", choices=["tiny", "small"], default="tiny")
    command.add_argument("--batches", type=int, default=4, help="cached batches per path")
    command.add_argument(
        "--recompute", choices=["never", "auto"], default="never", help="split(recompute=...)"
    )
    command.add_argument(
        "--steps",
        type=int,
        default=1,
        help="consecutive stage-2 steps per timed call (a training loop runs its steps back to "
        "back; with 1, every step follows another variant's, its caches cold)",
    )
    args = command.parse_args(argv)
    rounds, batches = (1, 1) if args.quick else (args.rounds, args.batches)
    with torch_threads(args.threads) as threads:
        results = [
            measure(case, args.size, rounds, batches, args.recompute, args.steps)
            for case in args.cases
        ]
    payload = report(
        "calls_overhead",
        results,
        {**environment("torch", "diffusers", "transformers", "peft"), "threads": threads},
    )
    write_results(args.out, "calls_overhead", payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
