"""Planning at full size: ``graphsplit.split()`` on real-sized configs built entirely on ``meta``.

No real weight is ever allocated: every module and every example input lives on the ``meta``
device, which is all ``split()`` needs (it reads shapes, dtypes and devices only). Cases:

- ``sdxl``: a CLIP-L text encoder, the SD VAE and an SDXL-sized ``UNet2DConditionModel``
  (cross-attention 768, fed by CLIP-L) with peft LoRA on ``to_q/to_k/to_v/to_out.0``; the
  zoo's :class:`~tests.zoo.SDLoRAStep`, batch 1 at 1024 px (latents 128 x 128).
- ``flux``: a 12B-parameter ``FluxTransformer2DModel`` with LoRA, a T5-XXL-sized
  ``T5EncoderModel`` (512 tokens), a CLIP-L text model for the pooled embedding and a Flux VAE
  (16 latent channels); a rectified-flow step written as users write it, batch 1 at 1024 px.
- ``wan``: Wan 2.1 14B text-to-video: diffusers' ``WanTransformer3DModel`` at the 14B config
  with peft LoRA on its attention projections, a UMT5-XXL ``UMT5EncoderModel`` (512 tokens)
  called with its attention mask, and the Wan VAE (``AutoencoderKLWan``'s default config)
  encoding the clip; a flow-matching step, batch 1, 81 frames at 480 x 832 (``WAN_VIDEO``).
- ``tiny``: the zoo's tiny SD step on ``meta`` (for the smoke test).

Each case runs in a fresh subprocess (``--child CASE``), so its ``ru_maxrss`` is its own: it
reports the time to build the models on ``meta``, the wall-clock and CPU time of ``split()``
(median and IQR of ``--rounds`` calls on one torch thread by default, after a warm-up split of
the tiny step that pays torch's and fx's first-call costs), the Python heap peak during
a second ``split()`` under tracemalloc, the process's RSS before and after, and the bytes the
weights *would* take, so "no real weight memory" can be checked against it. A case that fails
inside graphsplit is recorded with its error text (``status: "failed: ..."``); the others run.

    python -m benchmarks.bench_plan_scale                   # sdxl, flux (both), wan
    python -m benchmarks.bench_plan_scale --cases wan --profile   # and where its split goes
    python -m benchmarks.bench_plan_scale --cases tiny --out /tmp/results
    python -m benchmarks.bench_plan_scale --quick --out /tmp/results  # smoke test: tiny, once
    python -m benchmarks.bench_plan_scale --baseline HEAD~3 --rounds 4   # before/after ratios

With ``--baseline`` (a git revision or a folder holding a ``graphsplit`` package,
:func:`benchmarks.common.baseline_code`), each case also runs ``--rounds`` pairs of children,
one with this checkout's graphsplit and one with the baseline's, alternating which goes first;
the table gains the median (IQR) of the same-round ratios current / baseline of ``split()``'s
CPU and wall time, and whether the two plans are identical (the digest of every node's facts,
both stages' code and the boundary, :func:`plan_digest`).

Writes ``plan_scale.json`` and ``plan_scale.md`` to ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import (
    ChildFailed,
    baseline_code,
    baseline_table,
    compare_with_baseline,
    current_rss_bytes,
    environment,
    interleaved,
    markdown_table,
    mib,
    parser,
    peak_rss_bytes,
    python_heap_peak_bytes,
    ratio_text,
    reply_to_parent,
    report,
    run_child,
    timing_options,
    torch_threads,
    write_results,
)

DEFAULT_CASES = ("sdxl", "flux", "flux_diffusers_ids", "wan")
ALL_CASES = ("tiny", *DEFAULT_CASES)
META = torch.device("meta")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]

# -- configs ----------------------------------------------------------------------------------
CLIP_L = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 1,
}
T5_XXL = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "use_cache": False,
}
SD_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 1024,
}
FLUX_VAE = {
    **SD_VAE,
    "latent_channels": 16,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
SDXL_UNET = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 768,  # CLIP-L's width (SDXL proper concatenates two encoders: 2048)
    "use_linear_projection": True,
    "norm_num_groups": 32,
}
FLUX_DIT = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
UMT5_XXL = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "use_cache": False,
}
WAN_DIT = {  # Wan 2.1 T2V 14B
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
}
WAN_VIDEO = (81, 480, 832)  # frames, height, width: Wan 2.1's 480p clip
WAN_TOKENS = 512
RESOLUTION = 1024
T5_TOKENS = 512
CLIP_TOKENS = 77


# -- models -----------------------------------------------------------------------------------
def _frozen(module: nn.Module) -> nn.Module:
    module.requires_grad_(False)
    return module.eval()


def _lora(module: nn.Module, rank: int = 16) -> nn.Module:
    """diffusers' own ``add_adapter``, as in its LoRA training examples; only LoRA trains."""
    from peft import LoraConfig

    module.add_adapter(
        LoraConfig(
            r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=LORA_TARGETS
        )
    )
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
    return module.train()


def _clip_l() -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    return _frozen(CLIPTextModel(CLIPTextConfig(**CLIP_L)))


class FluxLoRAStep(nn.Module):
    """A rectified-flow (flow-matching) LoRA step for a Flux-style DiT, as users write it.

    ``forward(pixel_values, t5_ids, clip_ids)`` returns the velocity-matching loss. The VAE
    latent is sampled, shifted and scaled; ``t ~ U(0, 1)``; ``x_t = (1 - t) x0 + t noise``; the
    latent is packed into 2 x 2 patches as tokens; the DiT predicts ``noise - x0``. With
    ``diffusers_helpers`` the image position ids come from ``FluxPipeline``'s own helper (as in
    diffusers' Flux LoRA training script), which fills a ``torch.zeros(h, w, 3)`` in place.
    """

    def __init__(
        self, vae, t5, clip, transformer, guidance_scale=3.5, diffusers_helpers=False
    ) -> None:
        super().__init__()
        self.diffusers_helpers = diffusers_helpers
        self.vae = vae
        self.text_encoder = clip
        self.text_encoder_2 = t5
        self.transformer = transformer
        self.guidance_scale = guidance_scale

    @staticmethod
    def pack(latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return latents.reshape(b, (h // 2) * (w // 2), c * 4)

    @staticmethod
    def unpack(tokens: torch.Tensor, c: int, h: int, w: int) -> torch.Tensor:
        b = tokens.shape[0]
        tokens = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return tokens.reshape(b, c, h, w)

    def forward(self, pixel_values, t5_ids, clip_ids) -> torch.Tensor:
        config = self.vae.config
        x0 = self.vae.encode(pixel_values).latent_dist.sample()
        x0 = (x0 - config.shift_factor) * config.scaling_factor
        prompt_embeds = self.text_encoder_2(t5_ids)[0]
        pooled = self.text_encoder(clip_ids).pooler_output
        b, c, h, w = x0.shape
        noise = torch.randn_like(x0)
        t = torch.rand(b, device=x0.device, dtype=x0.dtype)
        x_t = (1 - t.view(b, 1, 1, 1)) * x0 + t.view(b, 1, 1, 1) * noise
        if self.diffusers_helpers:  # diffusers' train_dreambooth_lora_flux.py, verbatim
            from diffusers import FluxPipeline

            img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
        else:  # the same ids, written without in-place item assignment
            rows = torch.arange(h // 2, device=x0.device, dtype=x0.dtype)
            cols = torch.arange(w // 2, device=x0.device, dtype=x0.dtype)
            rows = rows[:, None].expand(h // 2, w // 2)
            cols = cols[None, :].expand(h // 2, w // 2)
            img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
        seq = prompt_embeds.shape[1]
        if self.diffusers_helpers:  # FluxPipeline.encode_prompt's text ids
            txt_ids = torch.zeros(seq, 3, device=x0.device, dtype=x0.dtype)
        else:
            txt_ids = torch.zeros((seq, 3), device=x0.device, dtype=x0.dtype)
        guidance = None
        if self.guidance_scale is not None:
            guidance = torch.full((b,), self.guidance_scale, device=x0.device)
        pred = self.transformer(
            hidden_states=self.pack(x_t),
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]
        target = noise - x0
        return F.mse_loss(self.unpack(pred, c, h, w).float(), target.float())


class WanLoRAStep(nn.Module):
    """A flow-matching LoRA step for Wan 2.1 text-to-video, as users write it.

    ``forward(video, input_ids, attention_mask)``: the VAE's latent mean, normalised with the
    VAE's ``latents_mean`` / ``latents_std``; the UMT5 prompt embeddings with the padding
    zeroed as ``WanPipeline`` does (its ``seq_lens`` loop, written without reading the mask's
    values); ``t ~ U(0, 1)``, ``x_t = (1 - t) x0 + t noise``; the DiT predicts ``noise - x0``.
    """

    def __init__(self, vae, text_encoder, transformer) -> None:
        super().__init__()
        self.vae = vae
        self.text_encoder = text_encoder
        self.transformer = transformer

    def forward(self, video, input_ids, attention_mask) -> torch.Tensor:
        config = self.vae.config
        x0 = self.vae.encode(video).latent_dist.mode()
        mean = torch.tensor(config.latents_mean, device=x0.device, dtype=x0.dtype)
        std = torch.tensor(config.latents_std, device=x0.device, dtype=x0.dtype)
        x0 = (x0 - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
        prompt = self.text_encoder(input_ids, attention_mask=attention_mask).last_hidden_state
        prompt = prompt * attention_mask[..., None].to(prompt.dtype)
        b = x0.shape[0]
        noise = torch.randn_like(x0)
        t = torch.rand(b, device=x0.device, dtype=x0.dtype)
        x_t = (1 - t.view(b, 1, 1, 1, 1)) * x0 + t.view(b, 1, 1, 1, 1) * noise
        pred = self.transformer(
            hidden_states=x_t,
            timestep=t * 1000,
            encoder_hidden_states=prompt,
            return_dict=False,
        )[0]
        return F.mse_loss(pred.float(), (noise - x0).float())


def build_tiny(batch: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from tests.zoo import SD_SIZES, build_sd_lora_step

    size = SD_SIZES["tiny"]
    step = build_sd_lora_step(size="tiny", frozen_on_meta=True, trainable_on_meta=True)
    with META:
        pixels = torch.empty(batch, 3, size.resolution, size.resolution)
        ids = torch.zeros(batch, size.max_tokens, dtype=torch.long)
    return step, (pixels, ids)


def build_sdxl(batch: int = 1) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    from tests.zoo import SDLoRAStep

    with META:
        vae = _frozen(AutoencoderKL(**SD_VAE))
        text_encoder = _clip_l()
        unet = _lora(_frozen(UNet2DConditionModel(**SDXL_UNET)))
        pixels = torch.empty(batch, 3, RESOLUTION, RESOLUTION)
        ids = torch.zeros(batch, CLIP_TOKENS, dtype=torch.long)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
    return SDLoRAStep(vae, text_encoder, unet, scheduler), (pixels, ids)


def build_flux(batch: int = 1, diffusers_helpers: bool = False) -> tuple[nn.Module, tuple]:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    with META:
        vae = _frozen(AutoencoderKL(**FLUX_VAE))
        t5 = _frozen(T5EncoderModel(T5Config(**T5_XXL)))
        clip = _clip_l()
        transformer = _lora(_frozen(FluxTransformer2DModel(**FLUX_DIT)))
        pixels = torch.empty(batch, 3, RESOLUTION, RESOLUTION)
        t5_ids = torch.zeros(batch, T5_TOKENS, dtype=torch.long)
        clip_ids = torch.zeros(batch, CLIP_TOKENS, dtype=torch.long)
    step = FluxLoRAStep(vae, t5, clip, transformer, diffusers_helpers=diffusers_helpers)
    return step, (pixels, t5_ids, clip_ids)


def build_flux_diffusers_ids(batch: int = 1) -> tuple[nn.Module, tuple]:
    return build_flux(batch, diffusers_helpers=True)


def build_wan(batch: int = 1) -> tuple[nn.Module, tuple]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    frames, height, width = WAN_VIDEO
    with META:
        vae = _frozen(AutoencoderKLWan())
        text_encoder = _frozen(UMT5EncoderModel(UMT5Config(**UMT5_XXL)))
        transformer = _lora(_frozen(WanTransformer3DModel(**WAN_DIT)))
        video = torch.empty(batch, 3, frames, height, width)
        ids = torch.zeros(batch, WAN_TOKENS, dtype=torch.long)
        mask = torch.ones(batch, WAN_TOKENS, dtype=torch.long)
    return WanLoRAStep(vae, text_encoder, transformer), (video, ids, mask)


def _with_first_shape(args: tuple, shape: tuple[int, ...]) -> tuple:
    """``args`` with the first (the pixels or the clip) replaced by an empty meta tensor."""
    with META:
        return (torch.empty(shape), *args[1:])


# Another shape signature per case (``--new-signature``): 768 x 1024 images, a 49-frame clip.
RESHAPED: dict[str, Callable[[tuple], tuple]] = {
    "sdxl": lambda args: _with_first_shape(args, (args[0].shape[0], 3, 768, RESOLUTION)),
    "flux": lambda args: _with_first_shape(args, (args[0].shape[0], 3, 768, RESOLUTION)),
    "wan": lambda args: _with_first_shape(args, (args[0].shape[0], 3, 49, *WAN_VIDEO[1:])),
}


BUILDERS: dict[str, Callable[[int], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "tiny": build_tiny,
    "sdxl": build_sdxl,
    "flux": build_flux,
    "flux_diffusers_ids": build_flux_diffusers_ids,
    "wan": build_wan,
}


# -- measuring (child process) ----------------------------------------------------------------
def _component_params(model: nn.Module) -> dict[str, float]:
    return {
        name: sum(p.numel() for p in child.parameters()) / 1e9
        for name, child in model.named_children()
        if next(child.parameters(), None) is not None
    }


def plan_digest(split: Any) -> str:
    """sha256 of what a plan decides: every node's facts, both stages' code and the boundary.

    Two versions of graphsplit that make the same plan give the same digest, so a speed-up
    that changed a shape, a FLOP count, a layout or the cut shows up as a different digest.
    """
    parts = [
        repr((node.name, node.op, _canonical(node.target), _canonical(node.meta.get("facts"))))
        for node in split.graph.nodes
    ]
    parts += [split.stage1.code, split.stage2.code, repr(_canonical(dict(split.boundary)))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` in a form whose repr is the same in every process: sets sorted, functions by
    qualified name (their repr holds an address), dataclasses field by field."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (
            type(value).__name__,
            *((f.name, _canonical(getattr(value, f.name))) for f in fields),
        )
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(_canonical(item)) for item in value))
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _canonical(item)) for key, item in value.items())
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', None)}.{value.__qualname__}"
    return repr(value)


def measure_case(
    case: str,
    batch: int | None = None,
    rounds: int = 1,
    *,
    heap: bool = True,
    profile: bool = False,
    new_signature: bool = False,
) -> dict[str, Any]:
    """Build ``case`` on meta and split it ``rounds`` times; everything a row of the table needs.

    ``heap=False`` skips the extra ``split()`` under tracemalloc (the baseline comparison's
    children only need the timings and the digest). ``profile=True`` adds one more ``split()``
    under cProfile and the phases it spent its time in (:mod:`benchmarks.plan_profile`).
    ``new_signature=True`` times a plan for another shape (:data:`RESHAPED`) as the dispatcher
    makes it (:func:`_new_signature`).
    """
    import graphsplit

    batch = batch or (2 if case == "tiny" else 1)
    row: dict[str, Any] = {
        "case": case,
        "batch": batch,
        "status": "ok",
        "torch_threads": torch.get_num_threads(),
    }
    graphsplit.split(*build_tiny())  # warm-up: first-call costs of torch, fx, diffusers
    row["rss_before_build_mib"] = mib(current_rss_bytes())
    try:
        started = time.perf_counter()
        model, args = BUILDERS[case](batch)
        row["build_seconds"] = time.perf_counter() - started
        row["rss_after_build_mib"] = mib(current_rss_bytes())
        params = list(model.parameters())
        row["params_billion"] = sum(p.numel() for p in params) / 1e9
        row["trainable_params_million"] = sum(p.numel() for p in params if p.requires_grad) / 1e6
        row["component_params_billion"] = _component_params(model)
        row["weights_gib_if_real"] = sum(p.numel() * p.element_size() for p in params) / 2**30
        row["all_params_on_meta"] = all(p.is_meta for p in params)
        row["batch_shapes"] = [list(a.shape) for a in args]
        split = None

        def split_once() -> None:
            nonlocal split
            split = None  # the previous plan is garbage before the next one is made
            split = graphsplit.split(model, args)

        timings = interleaved({"split": split_once}, rounds=max(1, rounds), warmup=0)
        assert split is not None
        row["split_seconds"] = timings.spread("split").median
        row["split_wall_seconds"] = timings.spread("split").to_json()
        row["split_cpu_seconds"] = timings.spread("split", "cpu").to_json()
        row["rss_after_split_mib"] = mib(current_rss_bytes())
        row["graph_nodes"] = len(split.graph.nodes)
        row["plan_digest"] = plan_digest(split)
        row["stage2_nodes"] = len(split.cut.stage2)
        row["boundary"] = {
            key: {"shape": list(spec.shape), "bytes_per_sample": spec.bytes_per_sample}
            for key, spec in split.boundary.items()
        }
        row["boundary_bytes_per_sample"] = sum(
            spec.bytes_per_sample for spec in split.boundary.values()
        )
        row["frozen_modules_in_stage2"] = [
            name
            for name, child in split.stage2.named_children()
            if next(child.parameters(), None) is not None
            and not any(p.requires_grad for p in child.parameters())
        ]
        row["notes"] = list(split.notes)
        del split
        if heap:
            peak = python_heap_peak_bytes(lambda: graphsplit.split(model, args))
            row["peak_python_mib"] = mib(peak)
        if new_signature and case in RESHAPED:
            row["new_signature"] = _new_signature(model, args, RESHAPED[case](args), rounds)
        if profile:
            from benchmarks.plan_profile import phase_profile

            components = dict(model.named_children()) if isinstance(model, nn.Module) else {}
            row["profile"] = phase_profile(lambda: graphsplit.split(model, args), components)
    except Exception as exc:  # a failing case is a result, not a crash of the benchmark
        text = str(exc).strip() or repr(exc)
        row["status"] = f"failed: {type(exc).__name__}: {text}"
    row["max_rss_mib"] = mib(peak_rss_bytes())
    return row


def _new_signature(model: nn.Module, args: tuple, other: tuple, rounds: int) -> dict[str, Any]:
    """A plan for ``other`` made as ``PlanSet`` makes one (``split.plan_set._make_plan``), on a
    split of ``args`` made untimed just before, against a first ``split()``, interleaved; and
    whether it is the plan a split of ``other`` alone makes."""
    import graphsplit

    fresh: list[Any] = []

    def new_split(name: str, _: int) -> None:
        fresh[:] = [graphsplit.split(model, args)] if name == "new signature" else []

    def new_plan() -> None:
        fresh.append(fresh[0].plan_set._make_plan(other, {}))

    timings = interleaved(
        {"first split": lambda: graphsplit.split(model, args), "new signature": new_plan},
        rounds=max(1, rounds),
        warmup=0,
        before_each=new_split,
    )
    made = plan_digest(fresh[1])
    del fresh[:]
    alone = plan_digest(graphsplit.split(model, other))
    return {
        "shape": list(other[0].shape),
        "first_cpu_seconds": timings.spread("first split", "cpu").to_json(),
        "new_cpu_seconds": timings.spread("new signature", "cpu").to_json(),
        "new_over_first": {
            clock: timings.ratio("new signature", "first split", clock).to_json()
            for clock in ("wall", "cpu")
        },
        "same_plan_as_its_own_split": made == alone,
    }


# -- orchestration (parent process) -----------------------------------------------------------
def run_case(
    case: str,
    timeout: float,
    batch: int | None = None,
    *,
    rounds: int = 1,
    threads: int = 1,
    code: Path | None = None,
    heap: bool = True,
    profile: bool = False,
    new_signature: bool = False,
) -> dict[str, Any]:
    """Run ``--child case`` in a fresh interpreter; a crash becomes a failed row.

    ``code`` is the folder whose graphsplit the child imports (None: this checkout's).
    """
    argv = ["--child", case, "--rounds", str(rounds), "--threads", str(threads)]
    argv += ["--batch", str(batch)] if batch else []
    argv += [] if heap else ["--no-heap"]
    argv += ["--profile"] if profile else []
    argv += ["--new-signature"] if new_signature else []
    try:
        return run_child("benchmarks.bench_plan_scale", argv, timeout=timeout, cwd=code)
    except subprocess.TimeoutExpired:
        return {"case": case, "status": f"failed: timed out after {timeout:.0f} s"}
    except ChildFailed as failure:
        return {"case": case, "status": f"failed: exit {failure.returncode}: {failure.tail}"}


def compare_case(
    case: str, baseline: Path, *, rounds: int, timeout: float, batch: int | None, threads: int
) -> dict[str, Any]:
    """Alternating children of this graphsplit and the baseline's: same-round ratios of split().

    Each child splits once after the warm-up; ``rounds`` pairs give the spread.
    """
    failures: list[str] = []

    def measure(code: Path | None) -> tuple[float, float, str]:
        row = run_case(case, timeout, batch, threads=threads, code=code, heap=False)
        if row["status"] != "ok":
            failures.append(f"{'baseline' if code else 'current'}: {row['status']}")
            return float("nan"), float("nan"), "?"
        wall, cpu = row["split_wall_seconds"]["median"], row["split_cpu_seconds"]["median"]
        return wall, cpu, row.get("plan_digest", "?")

    return {**compare_with_baseline(measure, baseline, rounds=rounds), "failures": failures}


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    return "–" if value is None else format(value, spec)


def _spread(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        return "–"
    return f"{value['median']:.2f} ({value['q1']:.2f}–{value['q3']:.2f})"


def to_markdown(results: list[dict[str, Any]]) -> str:
    table = _main_table(results)
    signed = [row for row in results if "new_signature" in row]
    if signed:
        table += "\n\nA new shape signature's plan against the first split:\n\n"
        table += _signature_table(signed)
    for row in results:
        if "profile" in row:
            from benchmarks.plan_profile import profile_table

            table += f"\n\nWhere `{row['case']}`'s split goes (cProfile):\n\n"
            table += profile_table(row["profile"])
    compared = [
        (row["case"], row["versus_baseline"]) for row in results if "versus_baseline" in row
    ]
    if not compared:
        return table
    return f"{table}\n{baseline_table(compared, 'case')}"


def _signature_table(rows: list[dict[str, Any]]) -> str:
    header = ["case", "new shape", "first split CPU s", "new plan CPU s", "new / first, CPU",
              "new / first, wall", "same plan as its own split"]  # fmt: skip
    cells = []
    for row in rows:
        signed = row["new_signature"]
        cells.append([
            row["case"], " x ".join(map(str, signed["shape"])),
            _spread(signed, "first_cpu_seconds"), _spread(signed, "new_cpu_seconds"),
            ratio_text(signed["new_over_first"]["cpu"]),
            ratio_text(signed["new_over_first"]["wall"]),
            "yes" if signed["same_plan_as_its_own_split"] else "**no**",
        ])  # fmt: skip
    return markdown_table(header, cells, "llrrrrl")


def _main_table(results: list[dict[str, Any]]) -> str:
    header = ["case", "batch", "params (B)", "weights if real (GiB)", "build on meta s",
              "split() wall s", "split() CPU s", "graph nodes", "boundary", "boundary bytes/sample",
              "peak Python MiB", "RSS before → after split MiB", "max RSS MiB",
              "frozen modules left in stage 2", "status"]  # fmt: skip
    return markdown_table(header, [_cells(row) for row in results], "lrrrrrrrlrrrrll")


def _cells(row: dict[str, Any]) -> list[str]:
    boundary = ", ".join(
        f"`{key}` {tuple(spec['shape'])}" for key, spec in row.get("boundary", {}).items()
    )
    rss = "–"
    if "rss_after_split_mib" in row:
        rss = f"{row['rss_before_build_mib']:.0f} → {row['rss_after_split_mib']:.0f}"
    return [
        row["case"], _fmt(row, "batch", "d"), _fmt(row, "params_billion", ".2f"),
        _fmt(row, "weights_gib_if_real", ".1f"), _fmt(row, "build_seconds", ".2f"),
        _spread(row, "split_wall_seconds"), _spread(row, "split_cpu_seconds"),
        _fmt(row, "graph_nodes", "d"), boundary or "–",
        _fmt(row, "boundary_bytes_per_sample", ",d"), _fmt(row, "peak_python_mib", ".1f"), rss,
        _fmt(row, "max_rss_mib", ".0f"),
        ", ".join(row.get("frozen_modules_in_stage2", [])) or "none",
        row["status"].splitlines()[0].replace("|", "\\|"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_plan_scale", __doc__), rounds=1)
    command.add_argument(
        "--cases",
        nargs="+",
        choices=ALL_CASES,
        default=list(DEFAULT_CASES),
        help="cases to run (default: sdxl flux flux_diffusers_ids wan; tiny: the zoo's tiny SD)",
    )
    command.add_argument(
        "--timeout", type=float, default=600, help="seconds allowed per case (default 600)"
    )
    command.add_argument(
        "--batch",
        type=int,
        help="example batch size (default: 1 for sdxl and flux, as at 1024 px; 2 for tiny)",
    )
    command.add_argument(
        "--baseline",
        metavar="REVISION_OR_FOLDER",
        help="also time another graphsplit (a git revision, or a folder holding a graphsplit "
        "package) in --rounds alternating pairs of children, and compare the plans",
    )
    command.add_argument(
        "--profile",
        action="store_true",
        help="also profile one more split() per case and report where it went (cProfile)",
    )
    command.add_argument(
        "--new-signature",
        action="store_true",
        help="also time a plan for another shape (768 x 1024 images, 49 frames) made as the "
        "dispatcher makes it, against a first split (interleaved, --rounds pairs)",
    )
    command.add_argument("--child", choices=ALL_CASES, help=argparse.SUPPRESS)
    command.add_argument("--no-heap", action="store_true", help=argparse.SUPPRESS)
    options = command.parse_args(argv)
    if options.child:
        with torch_threads(options.threads):
            row = measure_case(
                options.child,
                options.batch,
                options.rounds,
                heap=not options.no_heap,
                profile=options.profile,
                new_signature=options.new_signature,
            )
            reply_to_parent(row)
        return 0
    if options.quick:
        options.cases, options.rounds = ["tiny"], 1
    with tempfile.TemporaryDirectory(prefix="graphsplit-baseline-") as folder:
        baseline = baseline_code(options.baseline, Path(folder)) if options.baseline else None
        results = [_run(case, options, baseline) for case in options.cases]
    where = environment("graphsplit", "torch", "diffusers", "transformers")
    write_results(
        options.out, "plan_scale", report("plan_scale", results, where), to_markdown(results)
    )
    return 0


def _run(case: str, options: argparse.Namespace, baseline: Path | None) -> dict[str, Any]:
    """One case's row; with a baseline, its alternating comparison too."""
    row = run_case(
        case,
        options.timeout,
        options.batch,
        rounds=options.rounds,
        threads=options.threads,
        profile=options.profile,
        new_signature=options.new_signature,
    )
    print(
        f"{case}: {row['status'].splitlines()[0]}; split {_fmt(row, 'split_seconds', '.2f')} s,"
        f" max RSS {_fmt(row, 'max_rss_mib', '.0f')} MiB",
        flush=True,
    )
    if baseline is not None and row["status"] == "ok":
        versus = compare_case(
            case, baseline, rounds=options.rounds, timeout=options.timeout,
            batch=options.batch, threads=options.threads,
        )  # fmt: skip
        row["versus_baseline"] = {"baseline": options.baseline, **versus}
        print(
            f"{case}: current / baseline CPU {ratio_text(versus['cpu_ratio'])}, "
            f"same plan: {versus['same_plan']}",
            flush=True,
        )
    return row


if __name__ == "__main__":
    raise SystemExit(main())
