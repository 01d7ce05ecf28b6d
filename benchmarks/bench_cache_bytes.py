"""Bytes on disk per sample: graphsplit's min-cut boundary against the usual hand-made caches.

Three plans for the same text-to-image step, all computed from the traced shapes (full-size
models built on ``meta``; no weights, no data):

- every frozen output: cache everything each frozen module returns (all of a text encoder's
  outputs, the VAE's whole latent distribution), as a generic "cache the frozen modules" tool;
- one VAE sample: the latents *sampled once* plus the text embedding the step uses, as kohya /
  SimpleTuner / diffusers scripts do (smaller, but the VAE's randomness is frozen into the cache,
  so training on it is not the training the step describes);
- graphsplit: the min-cut boundary (the distribution's mean and log-variance, resampled every
  step, plus the embedding).

    python -m benchmarks.bench_cache_bytes --help
"""

from __future__ import annotations

import torch
import torch.fx as fx

import graphsplit
from benchmarks.common import markdown_table, parser, write_results
from graphsplit.planning.cut.boundary import module_owner


def _tensors(value) -> list[torch.Tensor]:
    """The tensors a module returned: ModelOutputs, tuples, a VAE distribution's parameters."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(getattr(value, "parameters", None), torch.Tensor):
        return [value.parameters]  # diffusers' DiagonalGaussianDistribution
    if hasattr(value, "to_tuple"):  # transformers / diffusers ModelOutput
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


def _tensor_bytes_per_sample(value, batch: int) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value)) // batch


def _frozen_calls(split: graphsplit.Split) -> list[fx.Node]:
    """Calls into frozen modules that stage 1 runs (and stage 2 does not)."""
    calls = []
    for node in split.graph.nodes:
        if node not in split.cut.stage1 or node in split.cut.stage2:
            continue
        owner = module_owner(node)  # vae.encode(x): the parameters belong to `vae`
        if owner is not None and owner.meta["facts"].params:
            calls.append(node)
    return calls


def plans(step: torch.nn.Module, args: tuple) -> dict[str, int]:
    """Bytes per sample of the three caching plans for an SD-style step (see module doc)."""
    split = graphsplit.split(step, args)
    batch = split.batch_sizes[0]
    every_output = sum(
        _tensor_bytes_per_sample(node.meta["val"], batch) for node in _frozen_calls(split)
    )
    latent = split.boundary["vae_encode_latent_dist_parameters"]
    text = split.boundary["text_encoder_0"]
    one_sample = latent.bytes_per_sample // 2 + text.bytes_per_sample  # mean-sized latents
    boundary = sum(spec.bytes_per_sample for spec in split.boundary.values())
    return {"every_frozen_output": every_output, "one_vae_sample": one_sample,
            "graphsplit": boundary}  # fmt: skip


def measure(case: str) -> dict:
    from benchmarks.bench_plan_scale import build_sdxl, build_tiny

    step, args = {"tiny": build_tiny, "sdxl": build_sdxl}[case]()
    result = plans(step, args)
    every, one = result["every_frozen_output"], result["one_vae_sample"]
    return {
        "case": case,
        "bytes_per_sample": result,
        "graphsplit_over_every_output": result["graphsplit"] / every,
        "graphsplit_over_one_sample": result["graphsplit"] / one,
    }


def to_markdown(results: list[dict]) -> str:
    header = ["case", "every frozen output", "one VAE sample (not exact)", "graphsplit (exact)",
              "graphsplit / every output", "graphsplit / one sample"]  # fmt: skip
    rows = [
        [
            r["case"],
            f"{r['bytes_per_sample']['every_frozen_output']:,}",
            f"{r['bytes_per_sample']['one_vae_sample']:,}",
            f"{r['bytes_per_sample']['graphsplit']:,}",
            f"{r['graphsplit_over_every_output']:.2f}",
            f"{r['graphsplit_over_one_sample']:.2f}",
        ]
        for r in results
    ]
    return markdown_table(header, rows, "lrrrrr")


def main(argv: list[str] | None = None) -> int:
    command = parser("bench_cache_bytes", __doc__)
    command.add_argument(
        "--cases",
        nargs="+",
        choices=("tiny", "sdxl"),
        default=["sdxl"],
        help="tiny: the zoo's tiny step; sdxl: full-size SDXL-like on meta",
    )
    args = command.parse_args(argv)
    results = [measure(case) for case in args.cases]
    write_results(args.out, "cache_bytes", results, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
