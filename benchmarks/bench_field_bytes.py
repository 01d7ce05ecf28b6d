"""Bytes per sample the module-level path caches, against a baseline version of graphsplit.

The module-level path stores only the output fields of a cached call that stage 2 reads
(``graphsplit/calls/usage.py``); before, every tensor of the output was stored. Bytes are
deterministic: each case is split once per version (a child process each, the baseline's
``graphsplit`` exported from a git revision by :func:`benchmarks.common.baseline_code`) and
the boundary's bytes per sample are summed; no timing.

Cases (random weights, built from configs):

- ``sd3``: diffusers' SD3 DreamBooth LoRA step with captions encoded in the step (the tiny
  conformance test, ``tests/conformance/test_unseen2_diffusers_sd3_dreambooth_lora.py``), 2
  samples; its two CLIP encoders are called with ``output_hidden_states=True``;
- ``clip-tiny``: SDXL's ``encode_prompt`` (two CLIP encoders, ``return_dict=False``, reading
  ``[0]`` and ``[-1][-2]``) at 16 wide, 3 layers, 7 tokens;
- ``sdxl-clip``: the same at SDXL's sizes: CLIP-L (12 layers, 768 wide) and OpenCLIP bigG
  (32 layers, 1280 wide), 77 tokens; the MLP is 64 wide instead of 3072 / 5120 (it changes no
  output's size, and keeps the run small).

    python -m benchmarks.bench_field_bytes --baseline integration-wip
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    baseline_code,
    environment,
    markdown_table,
    parser,
    reply_to_parent,
    report,
    run_child,
    write_results,
)

CASES = ("sd3", "clip-tiny", "sdxl-clip")


def _clip(width: int, layers: int, tokens: int, projection: int | None, seed: int) -> nn.Module:
    import transformers

    config = transformers.CLIPTextConfig(
        vocab_size=1000,
        hidden_size=width,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=max(width // 64, 2),
        max_position_embeddings=tokens,
        projection_dim=projection or width,
        bos_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    made = (
        transformers.CLIPTextModelWithProjection(config)
        if projection
        else transformers.CLIPTextModel(config)
    )
    return made.eval().requires_grad_(False)


class SDXLPrompt(nn.Module):
    """SDXL's ``encode_prompt`` (train_text_to_image_lora_sdxl.py) and a trainable head."""

    def __init__(self, sizes: tuple[tuple[int, int], tuple[int, int]], tokens: int) -> None:
        super().__init__()
        (width_one, layers_one), (width_two, layers_two) = sizes
        self.text_encoders = nn.ModuleList(
            [
                _clip(width_one, layers_one, tokens, None, 1),
                _clip(width_two, layers_two, tokens, width_two, 2),
            ]
        )
        self.head = nn.Linear(width_one + width_two, width_two)

    def forward(self, input_ids):
        prompt_embeds_list = []
        for text_encoder in self.text_encoders:
            prompt_embeds = text_encoder(input_ids, output_hidden_states=True, return_dict=False)
            pooled_prompt_embeds = prompt_embeds[0]
            prompt_embeds = prompt_embeds[-1][-2]
            bs_embed, seq_len, _ = prompt_embeds.shape
            prompt_embeds = prompt_embeds.view(bs_embed, seq_len, -1)
            prompt_embeds_list.append(prompt_embeds)
        prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
        pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)
        return (self.head(prompt_embeds).mean(1) * pooled_prompt_embeds).square().mean()


def _case(name: str) -> tuple[Any, tuple[Any, ...], str]:
    """``(step, example args, path)`` for a case."""
    if name == "sd3":
        from tests.conformance import test_unseen2_diffusers_sd3_dreambooth_lora as sd3

        parts = sd3.build(custom_instance_prompts=True)
        return parts.step, (sd3._batch(range(2), caption=True),), "auto"
    sizes, tokens = (
        (((16, 3), (16, 3)), 7) if name == "clip-tiny" else (((768, 12), (1280, 32)), 77)
    )
    ids = torch.randint(3, 1000, (2, tokens), generator=torch.Generator().manual_seed(0))
    return SDXLPrompt(sizes, tokens), (ids,), "calls"


def measure(name: str) -> dict[str, Any]:
    """Split the case with this process's graphsplit; its boundary's bytes per sample."""
    import graphsplit

    step, args, path = _case(name)
    split = graphsplit.split(step, args, path=path)
    assert split.path == "calls", split.path
    # The step's inputs cross either way; one only cached calls compute with crosses as its
    # shape (``<input>__shape``, graphsplit/calls/unstored_inputs), counted with the inputs.
    unstored = getattr(split.plan, "unstored", ())
    inputs = set(split.input_names) | {f"{name}__shape" for name in unstored}
    outputs = [spec for spec in split.boundary.values() if spec.name not in inputs]
    not_stored = getattr(split.plan, "not_stored", {})
    return {
        "case": name,
        "bytes_per_sample": sum(spec.bytes_per_sample for spec in split.boundary.values()),
        "output_bytes_per_sample": sum(spec.bytes_per_sample for spec in outputs),
        "output_tensors": len(outputs),
        "not_stored_bytes_per_sample": sum(s.bytes_per_sample for s in not_stored.values()),
    }


def main(argv: list[str] | None = None) -> int:
    command = parser("bench_field_bytes", __doc__ or "")
    command.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    command.add_argument(
        "--baseline",
        default="",
        help="git revision (or folder) of the graphsplit to compare with (default: none)",
    )
    command.add_argument("--quick", action="store_true", help="the clip-tiny case alone")
    command.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    options = command.parse_args(argv)
    if options.quick:
        options.cases = ["clip-tiny"]
    if options.child:
        torch.set_num_threads(1)
        reply_to_parent(measure(options.child))
        return 0
    rows, results = [], []
    with tempfile.TemporaryDirectory() as folder:
        code = baseline_code(options.baseline, Path(folder)) if options.baseline else None
        for name in options.cases:
            after = run_child("benchmarks.bench_field_bytes", ["--child", name])
            before = (
                run_child("benchmarks.bench_field_bytes", ["--child", name], cwd=code)
                if code is not None
                else None
            )
            results.append({"case": name, "current": after, "baseline": before})
            was = before["output_bytes_per_sample"] if before else None
            rows.append(
                [
                    name,
                    f"{was:,}" if was is not None else "-",
                    f"{before['output_tensors']}" if before else "-",
                    f"{after['output_bytes_per_sample']:,}",
                    f"{after['output_tensors']}",
                    f"{was / after['output_bytes_per_sample']:.1f}x" if was else "-",
                ]
            )
    header = [
        "case",
        f"cached bytes/sample ({options.baseline or 'no baseline'})",
        "tensors",
        "cached bytes/sample (this version)",
        "tensors",
        "ratio",
    ]
    markdown = markdown_table(header, rows, "lrrrrr") + "\n"
    payload = report("field_bytes", results, environment("torch", "transformers", "diffusers"))
    write_results(options.out, "field_bytes", payload, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
