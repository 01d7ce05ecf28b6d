"""Plans and planning time of a LoRA language model over a dataset of many padded lengths.

The step is transformers' Llama with peft's LoRA on ``q_proj`` / ``v_proj``, called as
``model(input_ids=..., attention_mask=..., labels=...).loss`` (what the Trainer's
``compute_loss`` does), split on the whole-step trace path, which goes into the ``LlamaModel``
to cache the frozen embeddings and layer 0's frozen projections. A batch padded to its longest
(``DataCollatorWithPadding``, TRL's collators) has a new length almost every time. Each child
process makes one split at the first length, then runs stage 1 on one batch of every other
length, as ``graphsplit.cache`` does over the dataset: a batch no plan fits makes a plan of its
own (a new shape signature), which is where the planning time goes.

Each child reports the plans made, the CPU and wall seconds of the split plus every stage-1
call (planning included: what caching the dataset costs beyond stage 1's own work), and the
same stage-1 calls again once every plan exists (stage 1's own work). ``--baseline`` runs the
same children with another graphsplit, alternating, as every planning benchmark does
(:func:`benchmarks.common.versus_baseline`).

    python -m benchmarks.bench_lm_lengths --baseline 6e58338 --rounds 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    baseline_code,
    environment,
    markdown_table,
    parser,
    reply_to_parent,
    report,
    run_child,
    spread,
    timing_options,
    torch_threads,
    write_results,
)

FIRST = 10
"""The example batch's padded length."""
LENGTHS = (12, 7, 9, 14, 11, 8, 13)
"""The other padded lengths of the dataset, in the order caching meets them."""


def _step(hidden: int, layers: int) -> tuple[Any, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )

    def step(input_ids: Any, attention_mask: Any, labels: Any) -> Any:
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    def batch(length: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(length)
        ids = torch.randint(1, 128, (4, length), generator=generator)
        mask = torch.ones(4, length, dtype=torch.long)
        mask[0, length - 2 :] = 0  # the first sample is shorter: padded on the right
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    return step, batch


def measure_once(hidden: int, layers: int) -> dict[str, Any]:
    """One child: a split at :data:`FIRST`, stage 1 at every length of :data:`LENGTHS`."""
    import graphsplit

    step, batch = _step(hidden, layers)
    batches = [batch(length) for length in LENGTHS]
    wall, cpu = time.perf_counter(), time.process_time()
    split = graphsplit.split(step, kwargs=batch(FIRST), max_plans=len(LENGTHS) + 1)
    for one in batches:
        split.stage1(**one)
    planned = (time.perf_counter() - wall, time.process_time() - cpu)
    wall, cpu = time.perf_counter(), time.process_time()
    for one in batches:
        split.stage1(**one)
    again = (time.perf_counter() - wall, time.process_time() - cpu)
    return {
        "plans": len(split.plans),
        "path": split.path,
        "wall": planned[0],
        "cpu": planned[1],
        "stage1_wall": again[0],
        "stage1_cpu": again[1],
    }


def _rows(children: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "plans": sorted({child["plans"] for child in children}),
        "path": sorted({child["path"] for child in children}),
        **{
            key: spread([child[key] for child in children]).to_json()
            for key in ("cpu", "wall", "stage1_cpu", "stage1_wall")
        },
    }


def to_markdown(results: dict[str, Any]) -> str:
    header = ["graphsplit", "plans for 8 lengths", "split + stage 1 at 7 more lengths, CPU s",
              "wall s", "stage 1 alone, CPU s"]  # fmt: skip
    cells = []
    for name, row in results["versions"].items():
        cells.append([
            name, "/".join(map(str, row["plans"])),
            f"{row['cpu']['median']:.2f} ({row['cpu']['q1']:.2f}–{row['cpu']['q3']:.2f})",
            f"{row['wall']['median']:.2f}", f"{row['stage1_cpu']['median']:.3f}",
        ])  # fmt: skip
    return (
        f"LoRA Llama (hidden {results['hidden']}, {results['layers']} layers), split at length "
        f"{FIRST}, then stage 1 at lengths {', '.join(map(str, LENGTHS))}; median (IQR) over "
        f"{results['rounds']} child processes per version, alternating\n\n"
        + markdown_table(header, cells, "lrrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_lm_lengths", __doc__), rounds=3)
    command.add_argument("--hidden", type=int, default=64, help="the model's hidden size")
    command.add_argument("--layers", type=int, default=2, help="decoder layers")
    command.add_argument(
        "--baseline",
        metavar="REVISION_OR_FOLDER",
        help="also run another graphsplit (a git revision, or a folder holding a graphsplit "
        "package) in alternating child processes",
    )
    command.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    options = command.parse_args(argv)
    if options.quick:
        options.hidden, options.layers, options.rounds = 32, 1, 1
    if options.child:
        with torch_threads(options.threads):
            reply_to_parent(measure_once(options.hidden, options.layers))
        return 0
    argv_child = ["--child", "--hidden", str(options.hidden), "--layers", str(options.layers),
                  "--threads", str(options.threads)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="graphsplit-baseline-") as folder:
        baseline = baseline_code(options.baseline, Path(folder)) if options.baseline else None
        where = {"current": None, **({"baseline": baseline} if baseline else {})}
        children: dict[str, list[dict[str, Any]]] = {name: [] for name in where}
        for index in range(options.rounds):
            for name in list(where) if index % 2 == 0 else list(where)[::-1]:
                children[name].append(
                    run_child("benchmarks.bench_lm_lengths", argv_child, cwd=where[name])
                )
    results = {
        "hidden": options.hidden,
        "layers": options.layers,
        "rounds": options.rounds,
        "baseline": options.baseline,
        "versions": {name: _rows(rows) for name, rows in children.items()},
    }
    payload = report("lm_lengths", results, environment("torch", "transformers", "peft"))
    write_results(options.out, "lm_lengths", payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
