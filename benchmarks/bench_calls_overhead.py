"""The module-level path's cost: stage 2 against the step written by hand, stage 1 and cache
bytes against the traced path, on the same step.

For each case, one step split twice, ``path="calls"`` and ``path="trace"``:

- stage-2 overhead: each round runs one training step (forward and backward, the generators
  seeded alike) of the calls path's ``stage2`` on its cached batch, and of the step the user
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
``--size`` picks the zoo size of both.

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

    ``by_hand(calls_boundary)`` returns the loss of the step with the frozen calls removed,
    computed from the raw batch's frozen outputs (``frozen(batch)``, computed once, untimed).
    """

    step: Any
    batches: list[Batch]
    frozen: Callable[[Batch], dict[str, Any]]
    by_hand: Callable[[Batch, dict[str, Any]], Any]


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

    step = KDStep()
    step.distillation_loss = distillation_loss  # the by-hand step shares the loss
    return step


KD_HIDDEN = {"tiny": 32, "small": 128}


def _kd(size: str, count: int) -> Case:
    import torch

    from tests.integrations.kd import padded_samples

    step = _kd_step(KD_HIDDEN[size])
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

    return Case(step, batches, frozen, by_hand)


CASES = {"sd": _sd, "kd": _kd}


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


def measure(case_name: str, size: str, rounds: int, batches: int) -> dict[str, Any]:
    import torch

    import graphsplit

    case = CASES[case_name](size, batches)
    example = case.batches[0]
    calls = graphsplit.split(case.step, kwargs=example, path="calls")
    traced = graphsplit.split(case.step, kwargs=example, path="trace")
    calls_boundary = calls.stage1(**example)
    traced_boundary = traced.stage1(**example)
    frozen = case.frozen(example)
    parameters = [p for p in case.step.parameters() if p.requires_grad]

    def train(loss: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            # The CPU generator alone: torch.manual_seed also queues CUDA / XPU / MTIA seeds,
            # each capturing a stack trace (0.3 ms a call), the same in every variant.
            torch.default_generator.manual_seed(0)
            loss().backward()

        return run

    def reset(name: str, index: int) -> None:
        for param in parameters:
            param.grad = None

    # The same seed and the same cached values: the three losses must agree before timing.
    torch.manual_seed(0)
    hand_loss = case.by_hand(example, frozen)
    torch.manual_seed(0)
    calls_loss = calls.stage2(**calls_boundary)
    torch.manual_seed(0)
    traced_loss = traced.stage2(**traced_boundary)
    agree = {
        "calls": bool(torch.allclose(calls_loss, hand_loss, rtol=1e-5, atol=1e-6)),
        "traced": bool(torch.allclose(traced_loss, hand_loss, rtol=1e-5, atol=1e-6)),
    }
    stage2 = interleaved(
        {
            "by hand": train(lambda: case.by_hand(example, frozen)),
            "calls stage 2": train(lambda: calls.stage2(**calls_boundary)),
            "traced stage 2": train(lambda: traced.stage2(**traced_boundary)),
        },
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
    with tempfile.TemporaryDirectory() as folder:
        calls_bytes, samples = _cache_bytes(calls, case.batches, Path(folder) / "calls")
        traced_bytes, _ = _cache_bytes(traced, case.batches, Path(folder) / "traced")
    return {
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
    }


def to_markdown(results: list[dict[str, Any]]) -> str:
    header = [
        "case",
        "hand step, CPU ms",
        "calls stage 2 / by hand (CPU)",
        "calls stage 2 / by hand (wall)",
        "traced stage 2 / by hand (CPU)",
        "stage 1 calls / traced (CPU)",
        "stage 1 calls / traced (wall)",
        "bytes/sample calls",
        "bytes/sample traced",
    ]
    rows = [
        [
            f"{r['case']} ({r['size']})",
            f"{r['hand_step_s']['median'] * 1e3:.1f}",
            ratio_text(r["calls_over_hand"]["cpu"]),
            ratio_text(r["calls_over_hand"]["wall"]),
            ratio_text(r["traced_over_hand"]["cpu"]),
            ratio_text(r["stage1_calls_over_traced"]["cpu"]),
            ratio_text(r["stage1_calls_over_traced"]["wall"]),
            f"{r['bytes_per_sample']['calls']:,.0f}",
            f"{r['bytes_per_sample']['traced']:,.0f}",
        ]
        for r in results
    ]
    return markdown_table(header, rows, "lrrrrrrrr")


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_calls_overhead", __doc__), rounds=30)
    command.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["sd", "kd"])
    command.add_argument("--size", choices=["tiny", "small"], default="tiny")
    command.add_argument("--batches", type=int, default=4, help="cached batches per path")
    args = command.parse_args(argv)
    rounds, batches = (1, 1) if args.quick else (args.rounds, args.batches)
    with torch_threads(args.threads) as threads:
        results = [measure(case, args.size, rounds, batches) for case in args.cases]
    payload = report(
        "calls_overhead",
        results,
        {**environment("torch", "diffusers", "transformers", "peft"), "threads": threads},
    )
    write_results(args.out, "calls_overhead", payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
