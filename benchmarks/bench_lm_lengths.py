"""Plans and planning time of a LoRA language model over a dataset of many padded lengths.

The step is transformers' Llama (``--arch``: or OPT, BART) with peft's LoRA on ``q_proj`` /
``v_proj``, called as
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


ARCHS = ("llama", "opt", "bart")
"""``--arch``: Llama (rotary positions, the cached embeddings carry the length), OPT (learned
positions from the mask's cumsum; the causal mask reads the frozen embeddings' length, off the
boundary), BART (an encoder-decoder whose encoder mask reads the same)."""


def _model(arch: str, hidden: int, layers: int) -> Any:
    import transformers

    if arch == "opt":
        return transformers.OPTForCausalLM(
            transformers.OPTConfig(
                vocab_size=128, hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=hidden,
            )
        )  # fmt: skip
    if arch == "bart":
        return transformers.BartForConditionalGeneration(
            transformers.BartConfig(
                vocab_size=128, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * hidden,
                decoder_ffn_dim=2 * hidden, max_position_embeddings=64, pad_token_id=0,
            )
        )  # fmt: skip
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )  # fmt: skip


def _step(arch: str, hidden: int, layers: int) -> tuple[Any, Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    targets = ["q_proj", "v_proj"]
    model = get_peft_model(_model(arch, hidden, layers), LoraConfig(r=4, target_modules=targets))

    def step(input_ids: Any, attention_mask: Any, labels: Any) -> Any:
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    def batch(length: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(length)
        ids = torch.randint(1, 128, (4, length), generator=generator)
        mask = torch.ones(4, length, dtype=torch.long)
        mask[0, length - 2 :] = 0  # the first sample is shorter: padded on the right
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    return step, batch


def measure_once(arch: str, hidden: int, layers: int) -> dict[str, Any]:
    """One child: a split at :data:`FIRST`, stage 1 at every length of :data:`LENGTHS`."""
    import graphsplit

    step, batch = _step(arch, hidden, layers)
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
        f"LoRA {results['arch']} (hidden {results['hidden']}, {results['layers']} layers), split "
        f"at length "
        f"{FIRST}, then stage 1 at lengths {', '.join(map(str, LENGTHS))}; median (IQR) over "
        f"{results['rounds']} child processes per version, alternating\n\n"
        + markdown_table(header, cells, "lrrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_lm_lengths", __doc__), rounds=3)
    command.add_argument("--arch", choices=ARCHS, default="llama", help="the model (see ARCHS)")
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
            reply_to_parent(measure_once(options.arch, options.hidden, options.layers))
        return 0
    argv_child = ["--child", "--arch", options.arch, "--hidden", str(options.hidden),
                  "--layers", str(options.layers), "--threads", str(options.threads)]  # fmt: skip
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
        "arch": options.arch,
        "hidden": options.hidden,
        "layers": options.layers,
        "rounds": options.rounds,
        "baseline": options.baseline,
        "versions": {name: _rows(rows) for name, rows in children.items()},
    }
    payload = report("lm_lengths", results, environment("torch", "transformers", "peft"))
    name = "lm_lengths" if options.arch == "llama" else f"lm_lengths_{options.arch}"
    write_results(options.out, name, payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
