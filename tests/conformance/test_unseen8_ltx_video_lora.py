"""Conformance: LTX-Video LoRA, finetrainers' training loop (``finetrainers/trainer.py``).

a-r-r-o-w/finetrainers (the ``ltx_video`` model with ``--training_type lora``): the loop body
of ``Trainer.train()`` without ``--precompute_conditions``, with the model functions of
``finetrainers/ltx_video/ltx_video_lora.py`` (``prepare_latents``, ``prepare_conditions`` /
``_encode_prompt_t5``, ``_normalize_latents``, ``_pack_latents``, ``forward_pass``,
``collate_fn_t2v``) and ``finetrainers/utils/diffusion_utils.py`` (``prepare_sigmas``,
``prepare_loss_weights``, ``prepare_target``, ``compute_density_for_timestep_sampling``),
copied verbatim. The frozen ``AutoencoderKLLTXVideo`` encodes the clip (``[B, F, C, H, W]``
permuted to ``[B, C, F, H, W]``) and its latent distribution is sampled from the trainer's own
``torch.Generator`` (``self.state.generator``), normalized by the VAE's ``latents_mean`` /
``latents_std`` buffers and packed into ``[B, F * H * W, C]`` tokens; the frozen
``T5EncoderModel`` embeds the batch's captions (the tokenizer called on the strings in the
step) with their attention mask; the caption dropout is a ``random.random()`` draw;
flow-matching sigmas (``--flow_weighting_scheme logit_normal``) and noise come from the same
generator; the ``LTXVideoTransformer3DModel`` with a peft LoRA on ``to_q/to_k/to_v/to_out.0``
(``transformer.add_adapter``) predicts the velocity, given the latent grid's ``num_frames`` /
``height`` / ``width`` as ints and ``rope_interpolation_scale``; the loss is the weighted
squared error, averaged over all but the batch dimension, then over the batch. Changes:
``self.`` attributes are closure variables, ``accelerator.device`` is the CPU, no mixed
precision (``weight_dtype`` fp32), the backward and optimizer step are the caller's.

What must hold: the step splits exactly (loss and every LoRA gradient bit for bit, on the
example and on a batch of another size), the T5 embeddings and the VAE's latent distribution
(both computed from the sample alone) are cached and neither frozen module's weights are in
stage 2, the distribution is resampled from the trainer's generator in stage 2, and a cache
written through the disk trains stage 2 exactly.

Tiny configs: diffusers' ``tests/pipelines/ltx/test_ltx.py`` components (transformer 4 heads of
8, one layer, caption channels 32; VAE (8, 8, 8, 8) channels, latent channels 8, spatio-temporal
scaling in the first two blocks), a 2-layer T5 32 wide, a real word-level tokenizer, clips of 9
frames of 16 px (3 x 4 x 4 latents), captions padded to 16 tokens.
"""

from __future__ import annotations

import random
import types
from typing import TYPE_CHECKING

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from diffusers import (  # noqa: E402
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXVideoTransformer3DModel,
)
from diffusers.training_utils import compute_loss_weighting_for_sd3  # noqa: E402
from transformers import T5EncoderModel  # noqa: E402

from tests.conformance.unseen2_data_checks import assert_same_step  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

if TYPE_CHECKING:
    from transformers import T5Tokenizer

WORDS = ["a", "dog", "runs", "on", "the", "beach", "cat", "jumps", "in", "snow", "BW_STYLE"]
CAPTIONS = [
    "BW_STYLE a dog runs on the beach",
    "BW_STYLE a cat jumps in the snow",
    "BW_STYLE a dog in snow",
    "BW_STYLE the cat",
]
FRAMES, SIZE, MAX_SEQUENCE_LENGTH = 9, 16, 16


# finetrainers/ltx_video/ltx_video_lora.py, verbatim (typing annotations in the PEP 604 style; the
# ``precompute`` branch of ``prepare_latents`` is the ``--precompute_conditions`` path).
def prepare_conditions(
    tokenizer: T5Tokenizer,
    text_encoder: T5EncoderModel,
    prompt: str | list[str],
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    max_sequence_length: int = 128,
    **kwargs,
) -> torch.Tensor:
    device = device or text_encoder.device
    dtype = dtype or text_encoder.dtype

    if isinstance(prompt, str):
        prompt = [prompt]

    return _encode_prompt_t5(tokenizer, text_encoder, prompt, device, dtype, max_sequence_length)


def prepare_latents(
    vae: AutoencoderKLLTXVideo,
    image_or_video: torch.Tensor,
    patch_size: int = 1,
    patch_size_t: int = 1,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
    precompute: bool = False,
) -> torch.Tensor:
    device = device or vae.device

    if image_or_video.ndim == 4:
        image_or_video = image_or_video.unsqueeze(2)
    assert image_or_video.ndim == 5, f"Expected 5D tensor, got {image_or_video.ndim}D tensor"

    image_or_video = image_or_video.to(device=device, dtype=vae.dtype)
    image_or_video = image_or_video.permute(
        0, 2, 1, 3, 4
    ).contiguous()  # [B, C, F, H, W] -> [B, F, C, H, W]
    if not precompute:
        latents = vae.encode(image_or_video).latent_dist.sample(generator=generator)
        latents = latents.to(dtype=dtype)
        _, _, num_frames, height, width = latents.shape
        latents = _normalize_latents(latents, vae.latents_mean, vae.latents_std)
        latents = _pack_latents(latents, patch_size, patch_size_t)
        return {"latents": latents, "num_frames": num_frames, "height": height, "width": width}
    raise AssertionError("--precompute_conditions: not the path tested here")


def collate_fn_t2v(batch: list[list[dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    return {
        "prompts": [x["prompt"] for x in batch[0]],
        "videos": torch.stack([x["video"] for x in batch[0]]),
    }


def forward_pass(
    transformer: LTXVideoTransformer3DModel,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    latents: torch.Tensor,
    noisy_latents: torch.Tensor,
    timesteps: torch.LongTensor,
    num_frames: int,
    height: int,
    width: int,
    **kwargs,
) -> torch.Tensor:
    # TODO(aryan): make configurable
    rope_interpolation_scale = [1 / 25, 32, 32]

    denoised_latents = transformer(
        hidden_states=noisy_latents,
        encoder_hidden_states=prompt_embeds,
        timestep=timesteps,
        encoder_attention_mask=prompt_attention_mask,
        num_frames=num_frames,
        height=height,
        width=width,
        rope_interpolation_scale=rope_interpolation_scale,
        return_dict=False,
    )[0]

    return {"latents": denoised_latents}


def _encode_prompt_t5(
    tokenizer: T5Tokenizer,
    text_encoder: T5EncoderModel,
    prompt: list[str],
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length,
) -> torch.Tensor:
    batch_size = len(prompt)

    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    text_input_ids = text_inputs.input_ids
    prompt_attention_mask = text_inputs.attention_mask
    prompt_attention_mask = prompt_attention_mask.bool().to(device)

    prompt_embeds = text_encoder(text_input_ids.to(device))[0]
    prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)
    prompt_attention_mask = prompt_attention_mask.view(batch_size, -1)

    return {"prompt_embeds": prompt_embeds, "prompt_attention_mask": prompt_attention_mask}


def _normalize_latents(
    latents: torch.Tensor,
    latents_mean: torch.Tensor,
    latents_std: torch.Tensor,
    scaling_factor: float = 1.0,
) -> torch.Tensor:
    # Normalize latents across the channel dimension [B, C, F, H, W]
    latents_mean = latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    latents_std = latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    latents = (latents - latents_mean) * scaling_factor / latents_std
    return latents


def _pack_latents(
    latents: torch.Tensor, patch_size: int = 1, patch_size_t: int = 1
) -> torch.Tensor:
    # Unpacked latents of shape are [B, C, F, H, W] are patched into tokens of shape
    # [B, C, F // p_t, p_t, H // p, p, W // p, p]. The patch dimensions are then permuted and
    # collapsed into the channel dimension of shape [B, F // p_t * H // p * W // p,
    # C * p_t * p * p] (an ndim=3 tensor).
    batch_size, num_channels, num_frames, height, width = latents.shape  # noqa: RUF059
    post_patch_num_frames = num_frames // patch_size_t
    post_patch_height = height // patch_size
    post_patch_width = width // patch_size
    latents = latents.reshape(
        batch_size,
        -1,
        post_patch_num_frames,
        patch_size_t,
        post_patch_height,
        patch_size,
        post_patch_width,
        patch_size,
    )
    latents = latents.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)
    return latents


# finetrainers/utils/diffusion_utils.py and torch_utils.py, verbatim.
def compute_density_for_timestep_sampling(
    weighting_scheme: str,
    batch_size: int,
    logit_mean: float = None,  # noqa: RUF013
    logit_std: float = None,  # noqa: RUF013
    mode_scale: float = None,  # noqa: RUF013
    device: torch.device = torch.device("cpu"),  # noqa: B008
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    if weighting_scheme == "logit_normal":
        # See 3.1 in the SD3 paper ($rf/lognorm(0.00,1.00)$).
        u = torch.normal(
            mean=logit_mean, std=logit_std, size=(batch_size,), device=device, generator=generator
        )
        u = torch.nn.functional.sigmoid(u)
    else:
        u = torch.rand(size=(batch_size,), device=device, generator=generator)
    return u


def get_scheduler_alphas(scheduler: FlowMatchEulerDiscreteScheduler) -> torch.Tensor:
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return None
    raise ValueError(f"Unsupported scheduler type {type(scheduler)}")


def get_scheduler_sigmas(scheduler: FlowMatchEulerDiscreteScheduler) -> torch.Tensor:
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler.sigmas.clone()
    raise ValueError(f"Unsupported scheduler type {type(scheduler)}")


def prepare_sigmas(
    scheduler: FlowMatchEulerDiscreteScheduler,
    sigmas: torch.Tensor,
    batch_size: int,
    num_train_timesteps: int,
    flow_weighting_scheme: str = "none",
    flow_logit_mean: float = 0.0,
    flow_logit_std: float = 1.0,
    flow_mode_scale: float = 1.29,
    device: torch.device = torch.device("cpu"),  # noqa: B008
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        weights = compute_density_for_timestep_sampling(
            weighting_scheme=flow_weighting_scheme,
            batch_size=batch_size,
            logit_mean=flow_logit_mean,
            logit_std=flow_logit_std,
            mode_scale=flow_mode_scale,
            device=device,
            generator=generator,
        )
        indices = (weights * num_train_timesteps).long()
    else:
        raise ValueError(f"Unsupported scheduler type {type(scheduler)}")

    return sigmas[indices]


def expand_tensor_dims(tensor, ndim):
    while len(tensor.shape) < ndim:
        tensor = tensor.unsqueeze(-1)
    return tensor


def prepare_loss_weights(
    scheduler: FlowMatchEulerDiscreteScheduler,
    alphas: torch.Tensor | None = None,
    sigmas: torch.Tensor | None = None,
    flow_weighting_scheme: str = "none",
) -> torch.Tensor:
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return compute_loss_weighting_for_sd3(sigmas=sigmas, weighting_scheme=flow_weighting_scheme)
    raise ValueError(f"Unsupported scheduler type {type(scheduler)}")


def prepare_target(
    scheduler: FlowMatchEulerDiscreteScheduler,
    noise: torch.Tensor,
    latents: torch.Tensor,
    is_mochi: bool = False,
) -> torch.Tensor:
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        target = noise - latents
    else:
        raise ValueError(f"Unsupported scheduler type {type(scheduler)}")

    return target


def make_contiguous(x):  # finetrainers/utils/memory_utils.py
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    elif isinstance(x, dict):
        return {k: make_contiguous(v) for k, v in x.items()}
    else:
        return x


def _models():
    """``load_condition_models`` / ``load_latent_models`` / ``load_diffusion_models``, on
    diffusers' LTX pipeline test components."""
    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=1,
        caption_channels=32,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        spatio_temporal_scaling=(True, True, False, False),
        layers_per_block=(1, 1, 1, 1, 1),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(
        transformers.T5Config(
            vocab_size=len(WORDS) + 3,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
        )
    )
    tokenizer = word_tokenizer(WORDS)
    scheduler = FlowMatchEulerDiscreteScheduler()
    for model in (transformer, vae, text_encoder):
        model.eval()  # as from_pretrained returns them
    return tokenizer, text_encoder, vae, transformer, scheduler


def build(*, caption_dropout_p: float = 0.0, caption_dropout_technique: str = "empty"):
    """``Trainer``'s setup (``prepare_models``, ``prepare_trainable_parameters`` for LoRA,
    ``train()``'s preamble) and the loop body as a closure."""
    tokenizer, text_encoder, vae, transformer, scheduler = _models()
    args = types.SimpleNamespace(
        seed=42,
        precompute_conditions=False,
        caption_dropout_technique=caption_dropout_technique,
        caption_dropout_p=caption_dropout_p,
        flow_weighting_scheme="logit_normal",
        flow_logit_mean=0.0,
        flow_logit_std=1.0,
        flow_mode_scale=1.29,
        rank=4,
        lora_alpha=4,
        target_modules=["to_q", "to_k", "to_v", "to_out.0"],
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    weight_dtype = torch.float32
    transformer_config = transformer.config

    # prepare_trainable_parameters
    components = [text_encoder, vae, transformer]
    for component in components:
        if component is not None:
            component.requires_grad_(False)
    torch.manual_seed(1)
    transformer_lora_config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.lora_alpha,
        init_lora_weights=True,
        target_modules=args.target_modules,
    )
    transformer.add_adapter(transformer_lora_config)
    with torch.no_grad():  # as after some steps: lora_B starts at zero
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)

    # train()
    generator = torch.Generator(device=accelerator.device)
    if args.seed is not None:
        generator = generator.manual_seed(args.seed)
    state = types.SimpleNamespace(generator=generator)
    scheduler_sigmas = get_scheduler_sigmas(scheduler).to(
        device=accelerator.device, dtype=torch.float32
    )
    scheduler_alphas = get_scheduler_alphas(scheduler)
    transformer.train()

    def training_step(batch):
        if not args.precompute_conditions:
            videos = batch["videos"]
            prompts = batch["prompts"]
            batch_size = len(prompts)

            if args.caption_dropout_technique == "empty":  # noqa: SIM102
                if random.random() < args.caption_dropout_p:
                    prompts = [""] * batch_size

            latent_conditions = prepare_latents(
                vae=vae,
                image_or_video=videos,
                patch_size=transformer_config.patch_size,
                patch_size_t=transformer_config.patch_size_t,
                device=accelerator.device,
                dtype=weight_dtype,
                generator=state.generator,
            )
            text_conditions = prepare_conditions(
                tokenizer=tokenizer,
                text_encoder=text_encoder,
                tokenizer_2=None,
                text_encoder_2=None,
                prompt=prompts,
                device=accelerator.device,
                dtype=weight_dtype,
                max_sequence_length=MAX_SEQUENCE_LENGTH,  # the model's default is 128
            )

        latent_conditions = make_contiguous(latent_conditions)
        text_conditions = make_contiguous(text_conditions)

        if args.caption_dropout_technique == "zero":  # noqa: SIM102
            if random.random() < args.caption_dropout_p:
                text_conditions["prompt_embeds"].fill_(0)
                text_conditions["prompt_attention_mask"].fill_(False)

                # TODO(aryan): refactor later
                if "pooled_prompt_embeds" in text_conditions:
                    text_conditions["pooled_prompt_embeds"].fill_(0)

        sigmas = prepare_sigmas(
            scheduler=scheduler,
            sigmas=scheduler_sigmas,
            batch_size=batch_size,
            num_train_timesteps=scheduler.config.num_train_timesteps,
            flow_weighting_scheme=args.flow_weighting_scheme,
            flow_logit_mean=args.flow_logit_mean,
            flow_logit_std=args.flow_logit_std,
            flow_mode_scale=args.flow_mode_scale,
            device=accelerator.device,
            generator=state.generator,
        )
        timesteps = (sigmas * 1000.0).long()

        noise = torch.randn(
            latent_conditions["latents"].shape,
            generator=state.generator,
            device=accelerator.device,
            dtype=weight_dtype,
        )
        sigmas = expand_tensor_dims(sigmas, ndim=noise.ndim)

        # Default to flow-matching noise addition
        noisy_latents = (1.0 - sigmas) * latent_conditions["latents"] + sigmas * noise

        latent_conditions.update({"noisy_latents": noisy_latents})

        weights = prepare_loss_weights(
            scheduler=scheduler,
            alphas=scheduler_alphas[timesteps] if scheduler_alphas is not None else None,
            sigmas=sigmas,
            flow_weighting_scheme=args.flow_weighting_scheme,
        )
        weights = expand_tensor_dims(weights, noise.ndim)

        pred = forward_pass(
            transformer=transformer,
            scheduler=scheduler,
            timesteps=timesteps,
            **latent_conditions,
            **text_conditions,
        )
        target = prepare_target(
            scheduler=scheduler, noise=noise, latents=latent_conditions["latents"]
        )

        loss = weights.float() * (pred["latents"].float() - target.float()).pow(2)
        # Average loss across all but batch dimension
        loss = loss.mean(list(range(1, loss.ndim)))
        # Average loss across batch dimension
        loss = loss.mean()
        return loss

    params = [p for p in transformer.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        params=params,
        generator=generator,
    )


def _example(index: int) -> dict:
    """``VideoDataset.__getitem__``: the clip's frames ``[F, C, H, W]`` in [-1, 1] and its
    caption (with the id token)."""
    generator = torch.Generator().manual_seed(700 + index)
    return {
        "prompt": CAPTIONS[index % len(CAPTIONS)],
        "video": torch.rand(FRAMES, 3, SIZE, SIZE, generator=generator) * 2 - 1,
    }


def _batch(indices) -> dict:
    # The bucket sampler yields a list of one bucket's examples: ``collate_fn_t2v`` reads
    # ``batch[0]``.
    return collate_fn_t2v([[_example(i) for i in indices]])


_BUILT: list = []


def _built():
    if not _BUILT:
        parts = build()
        _BUILT.append((parts, graphsplit.split(parts.step, (_batch([0, 1]),))))
    return _BUILT[0]


def test_the_trace_refuses_the_tokenizer_on_the_captions_naming_the_line():
    parts = build()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    assert line_of(_encode_prompt_t5, "text_inputs = tokenizer(") in str(caught.value)


def test_ltx_step_verifies_on_the_example_and_another_size():
    parts, split = _built()
    assert split.path == "calls"
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_ltx_caches_the_t5_embeddings_and_the_latent_distribution():
    parts, split = _built()
    per_sample = {key: tuple(spec.shape[1:]) for key, spec in split.boundary.items()}
    assert per_sample["text_encoder__0__last_hidden_state"] == (MAX_SEQUENCE_LENGTH, 32)
    # The VAE encoder's moments (mean and log-variance of 8 channels) of the 3 x 4 x 4 latent
    # grid: the distribution, sampled from the trainer's generator in stage 2.
    assert per_sample["vae_encoder__0__out"] == (16, 3, 4, 4)
    assert "videos" in split.plan.unstored  # only the cached VAE reads the clip
    stage1 = {".".join(n.split(".")[:2]) for n, _ in split.stage1.named_parameters()}
    assert {"vae.encoder", "text_encoder.encoder", "text_encoder.shared"} <= stage1
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith(("vae.", "text_encoder.")) for name in held)
    assert "text_encoder" not in stage2_top_modules(split)
    # Of the VAE, stage 2 holds only the buffers the step normalizes with, never a weight.
    vae_held = [n for n, _ in split.stage2.named_modules() if n.startswith("vae")]
    assert vae_held == ["vae"]
    assert {n for n, _ in split.stage2.named_buffers() if n.startswith("vae")} == {
        "vae.latents_mean",
        "vae.latents_std",
    }
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {
        f"transformer.{n}" for n, p in parts.transformer.named_parameters() if p.requires_grad
    }
    assert len(trainable) == 4 * 2 * 2  # lora_A / lora_B on q, k, v, out of two attentions


def test_ltx_cache_round_trip(tmp_path):
    """The trainer's generator (latent sampling, sigmas, noise) is set alike before the
    unsplit step and before stage 2: ``torch.manual_seed`` does not reseed it."""
    parts, split = _built()
    loader = [_batch([5, 6]), _batch([7, 8, 9]), _batch([10])]
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(cached) == 6
    row = 0
    for seed, raw in enumerate(loader):
        size = len(raw["prompts"])
        rows = [cached[row + offset] for offset in range(size)]
        row += size

        def expected(raw=raw, seed=seed):
            parts.generator.manual_seed(100 + seed)
            return parts.step(raw)

        def actual(rows=rows, seed=seed):
            parts.generator.manual_seed(100 + seed)
            return split.stage2(**graphsplit.collate(rows))

        assert_same_step(expected, actual, parts.params, seed)


def _first_seed_drawing_below(p: float) -> int:
    """A seed of Python's ``random`` whose first ``random.random()`` is below ``p``."""
    for seed in range(1000):
        random.seed(seed)
        if random.random() < p:
            return seed
    raise AssertionError(p)


def test_caption_dropout_empty_trains_from_the_cache_as_the_step(tmp_path):
    """``--caption_dropout_technique empty``: on a drop the prompts become empty strings
    before T5 encodes them. The cache is written without a drop; stage 2 then meets one."""
    _caption_dropout_trains_from_the_cache("empty", tmp_path)


# Both caption-dropout tests were strict xfails: with --caption_dropout_p 0.05 (finetrainers'
# LTX example command) neither probe seed (first random.random() 0.84 and 0.13) drops a
# caption, so the text encoder and the transformer's calls on the embedding were cached, and
# a stage-2 step that dropped one trained on the kept caption's embedding, silently (verify()
# runs both stages under one seed). The module-level path now runs the step again with
# Python's and NumPy's draws forced to both ends of their range (calls/forced_draws).


def test_caption_dropout_zero_trains_from_the_cache_as_the_step(tmp_path):
    """``--caption_dropout_technique zero``: on a drop T5's output is zeroed in place
    (``text_conditions["prompt_embeds"].fill_(0)``) after the frozen call. T5 itself may be
    cached; the transformer's frozen calls on the zeroed embedding may not."""
    _caption_dropout_trains_from_the_cache("zero", tmp_path)


def _caption_dropout_trains_from_the_cache(technique: str, folder) -> None:
    p = 0.05
    parts = build(caption_dropout_p=p, caption_dropout_technique=technique)
    split = graphsplit.split(parts.step, (_batch([0, 1]),))
    assert split.path == "calls"
    assert "forced to the bottom" in split.report()  # the steered calls' verdicts say so
    raw = _batch([2, 3])
    random.seed(0)  # the first draw, 0.84: no drop while caching
    graphsplit.cache(split, [raw], folder / "cache", progress=False)
    cached = graphsplit.CachedDataset(folder / "cache", split)
    rows = [cached[0], cached[1]]
    drop = _first_seed_drawing_below(p)

    def expected():
        random.seed(drop)
        parts.generator.manual_seed(5)
        return parts.step(raw)

    def actual():
        random.seed(drop)
        parts.generator.manual_seed(5)
        return split.stage2(**graphsplit.collate(rows))

    assert_same_step(expected, actual, parts.params, 0)
