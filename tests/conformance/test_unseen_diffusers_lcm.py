"""Conformance: ``examples/consistency_distillation/train_lcm_distill_lora_sd_wds.py``'s step.

Latent consistency distillation: a LoRA student (``get_peft_model``) against a frozen teacher
UNet, a DDIM solver step, guidance scales ``w`` drawn per sample, a target from the student
itself under ``torch.no_grad()``, and prompts tokenized inside the step (the webdataset batch
is ``(image, text)``, text a list of captions; ``encode_prompt`` also calls ``random``).
The trace path refuses the tuple batch on purpose and ``auto`` falls back to the module-level
path. The step only runs at ``train_batch_size`` (its ``uncond_prompt_embeds`` is built for
that size), so the last sample cannot run alone: the module path shows the text encoder's and
the VAE's calls per sample at the batch's own size, its samples reordered and repeated
(``graphsplit/calls/reordered.py``).
"""

from __future__ import annotations

import copy
import functools
import random
import types
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
    word_tokenizer,
)
from tests.zoo import build_frozen_sd  # noqa: E402


def append_dims(x, target_dims):
    """Appends dimensions to the end of a tensor until it has target_dims dimensions."""
    dims_to_append = target_dims - x.ndim
    if dims_to_append < 0:
        raise ValueError(f"input has {x.ndim} dims but target_dims is {target_dims}, which is less")
    return x[(...,) + (None,) * dims_to_append]


# From LCMScheduler.get_scalings_for_boundary_condition_discrete
def scalings_for_boundary_conditions(timestep, sigma_data=0.5, timestep_scaling=10.0):
    scaled_timestep = timestep_scaling * timestep
    c_skip = sigma_data**2 / (scaled_timestep**2 + sigma_data**2)
    c_out = scaled_timestep / (scaled_timestep**2 + sigma_data**2) ** 0.5
    return c_skip, c_out


# Compare LCMScheduler.step, Step 4
def get_predicted_original_sample(model_output, timesteps, sample, prediction_type, alphas, sigmas):
    alphas = extract_into_tensor(alphas, timesteps, sample.shape)
    sigmas = extract_into_tensor(sigmas, timesteps, sample.shape)
    if prediction_type == "epsilon":
        pred_x_0 = (sample - sigmas * model_output) / alphas
    elif prediction_type == "sample":
        pred_x_0 = model_output
    elif prediction_type == "v_prediction":
        pred_x_0 = alphas * sample - sigmas * model_output
    else:
        raise ValueError(f"Prediction type {prediction_type} is not supported")

    return pred_x_0


# Based on step 4 in DDIMScheduler.step
def get_predicted_noise(model_output, timesteps, sample, prediction_type, alphas, sigmas):
    alphas = extract_into_tensor(alphas, timesteps, sample.shape)
    sigmas = extract_into_tensor(sigmas, timesteps, sample.shape)
    if prediction_type == "epsilon":
        pred_epsilon = model_output
    elif prediction_type == "sample":
        pred_epsilon = (sample - alphas * model_output) / sigmas
    elif prediction_type == "v_prediction":
        pred_epsilon = alphas * model_output + sigmas * sample
    else:
        raise ValueError(f"Prediction type {prediction_type} is not supported")

    return pred_epsilon


def extract_into_tensor(a, t, x_shape):
    b, *_ = t.shape
    out = a.gather(-1, t)
    return out.reshape(b, *((1,) * (len(x_shape) - 1)))


class DDIMSolver:
    """The script's ``DDIMSolver``, verbatim."""

    def __init__(self, alpha_cumprods, timesteps=1000, ddim_timesteps=50):
        # DDIM sampling parameters
        step_ratio = timesteps // ddim_timesteps
        self.ddim_timesteps = (np.arange(1, ddim_timesteps + 1) * step_ratio).round().astype(
            np.int64
        ) - 1
        self.ddim_alpha_cumprods = alpha_cumprods[self.ddim_timesteps]
        self.ddim_alpha_cumprods_prev = np.asarray(
            [alpha_cumprods[0]] + alpha_cumprods[self.ddim_timesteps[:-1]].tolist()  # noqa: RUF005
        )
        # convert to torch tensors
        self.ddim_timesteps = torch.from_numpy(self.ddim_timesteps).long()
        self.ddim_alpha_cumprods = torch.from_numpy(self.ddim_alpha_cumprods)
        self.ddim_alpha_cumprods_prev = torch.from_numpy(self.ddim_alpha_cumprods_prev)

    def ddim_step(self, pred_x0, pred_noise, timestep_index):
        alpha_cumprod_prev = extract_into_tensor(
            self.ddim_alpha_cumprods_prev, timestep_index, pred_x0.shape
        )
        dir_xt = (1.0 - alpha_cumprod_prev).sqrt() * pred_noise
        x_prev = alpha_cumprod_prev.sqrt() * pred_x0 + dir_xt
        return x_prev


@torch.no_grad()
def encode_prompt(prompt_batch, text_encoder, tokenizer, proportion_empty_prompts, is_train=True):
    """The script's ``encode_prompt``, verbatim."""
    captions = []
    for caption in prompt_batch:
        if random.random() < proportion_empty_prompts:
            captions.append("")
        elif isinstance(caption, str):
            captions.append(caption)
        elif isinstance(caption, (list, np.ndarray)):
            # take a random caption if there are multiple
            captions.append(random.choice(caption) if is_train else caption[0])

    with torch.no_grad():
        text_inputs = tokenizer(
            captions,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
        text_input_ids = text_inputs.input_ids
        prompt_embeds = text_encoder(text_input_ids.to(text_encoder.device))[0]

    return prompt_embeds


CAPTIONS = ["a red circle", "a blue square", "green stripes", "a white gradient"]


def build(train_batch_size: int = 2):
    """``main()``: teacher, LoRA student, solver, the loop body over a ``(image, text)`` batch."""
    vae, text_encoder, teacher_unet, noise_scheduler = build_frozen_sd()
    unet = copy.deepcopy(teacher_unet)  # both from_pretrained of the same teacher
    unet.requires_grad_(False)
    args = types.SimpleNamespace(
        num_ddim_timesteps=50,
        vae_encode_batch_size=32,
        timestep_scaling_factor=10.0,
        w_min=5.0,
        w_max=15.0,
        loss_type="huber",
        huber_c=0.001,
    )
    alpha_schedule = torch.sqrt(noise_scheduler.alphas_cumprod)
    sigma_schedule = torch.sqrt(1 - noise_scheduler.alphas_cumprod)
    solver = DDIMSolver(
        noise_scheduler.alphas_cumprod.numpy(),
        timesteps=noise_scheduler.config.num_train_timesteps,
        ddim_timesteps=args.num_ddim_timesteps,
    )
    tokenizer = word_tokenizer(" ".join(CAPTIONS).split(), eos=None)
    tokenizer.model_max_length = 16
    lora_config = peft.LoraConfig(
        r=4,
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out"],
        lora_alpha=4,
        lora_dropout=0.0,
    )
    unet = peft.get_peft_model(unet, lora_config)
    with torch.no_grad():  # peft's zero lora_B would make every lora_A gradient zero
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    unet.train()
    weight_dtype = torch.float32
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    def compute_embeddings(
        prompt_batch, proportion_empty_prompts, text_encoder, tokenizer, is_train=True
    ):
        prompt_embeds = encode_prompt(
            prompt_batch, text_encoder, tokenizer, proportion_empty_prompts, is_train
        )
        return {"prompt_embeds": prompt_embeds}

    compute_embeddings_fn = functools.partial(
        compute_embeddings,
        proportion_empty_prompts=0,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )
    uncond_input_ids = tokenizer(
        [""] * train_batch_size, return_tensors="pt", padding="max_length", max_length=16
    ).input_ids.to(accelerator.device)
    uncond_prompt_embeds = text_encoder(uncond_input_ids)[0]
    autocast_ctx = nullcontext()

    def training_step(batch):
        image, text = batch

        image = image.to(accelerator.device, non_blocking=True)
        encoded_text = compute_embeddings_fn(text)

        pixel_values = image.to(dtype=weight_dtype)
        if vae.dtype != weight_dtype:
            vae.to(dtype=weight_dtype)

        latents = []
        for i in range(0, pixel_values.shape[0], args.vae_encode_batch_size):
            latents.append(
                vae.encode(pixel_values[i : i + args.vae_encode_batch_size]).latent_dist.sample()
            )
        latents = torch.cat(latents, dim=0)

        latents = latents * vae.config.scaling_factor
        latents = latents.to(weight_dtype)
        bsz = latents.shape[0]

        topk = noise_scheduler.config.num_train_timesteps // args.num_ddim_timesteps
        index = torch.randint(0, args.num_ddim_timesteps, (bsz,), device=latents.device).long()
        start_timesteps = solver.ddim_timesteps[index]
        timesteps = start_timesteps - topk
        timesteps = torch.where(timesteps < 0, torch.zeros_like(timesteps), timesteps)

        c_skip_start, c_out_start = scalings_for_boundary_conditions(
            start_timesteps, timestep_scaling=args.timestep_scaling_factor
        )
        c_skip_start, c_out_start = [
            append_dims(x, latents.ndim) for x in [c_skip_start, c_out_start]
        ]
        c_skip, c_out = scalings_for_boundary_conditions(
            timesteps, timestep_scaling=args.timestep_scaling_factor
        )
        c_skip, c_out = [append_dims(x, latents.ndim) for x in [c_skip, c_out]]

        noise = torch.randn_like(latents)
        noisy_model_input = noise_scheduler.add_noise(latents, noise, start_timesteps)

        w = (args.w_max - args.w_min) * torch.rand((bsz,)) + args.w_min
        w = w.reshape(bsz, 1, 1, 1)
        w = w.to(device=latents.device, dtype=latents.dtype)

        prompt_embeds = encoded_text.pop("prompt_embeds")

        noise_pred = unet(
            noisy_model_input,
            start_timesteps,
            timestep_cond=None,
            encoder_hidden_states=prompt_embeds.float(),
            added_cond_kwargs=encoded_text,
        ).sample

        pred_x_0 = get_predicted_original_sample(
            noise_pred,
            start_timesteps,
            noisy_model_input,
            noise_scheduler.config.prediction_type,
            alpha_schedule,
            sigma_schedule,
        )

        model_pred = c_skip_start * noisy_model_input + c_out_start * pred_x_0

        with torch.no_grad():  # noqa: SIM117 (the script's)
            with autocast_ctx:
                cond_teacher_output = teacher_unet(
                    noisy_model_input.to(weight_dtype),
                    start_timesteps,
                    encoder_hidden_states=prompt_embeds.to(weight_dtype),
                ).sample
                cond_pred_x0 = get_predicted_original_sample(
                    cond_teacher_output,
                    start_timesteps,
                    noisy_model_input,
                    noise_scheduler.config.prediction_type,
                    alpha_schedule,
                    sigma_schedule,
                )
                cond_pred_noise = get_predicted_noise(
                    cond_teacher_output,
                    start_timesteps,
                    noisy_model_input,
                    noise_scheduler.config.prediction_type,
                    alpha_schedule,
                    sigma_schedule,
                )

                uncond_teacher_output = teacher_unet(
                    noisy_model_input.to(weight_dtype),
                    start_timesteps,
                    encoder_hidden_states=uncond_prompt_embeds.to(weight_dtype),
                ).sample
                uncond_pred_x0 = get_predicted_original_sample(
                    uncond_teacher_output,
                    start_timesteps,
                    noisy_model_input,
                    noise_scheduler.config.prediction_type,
                    alpha_schedule,
                    sigma_schedule,
                )
                uncond_pred_noise = get_predicted_noise(
                    uncond_teacher_output,
                    start_timesteps,
                    noisy_model_input,
                    noise_scheduler.config.prediction_type,
                    alpha_schedule,
                    sigma_schedule,
                )

                pred_x0 = cond_pred_x0 + w * (cond_pred_x0 - uncond_pred_x0)
                pred_noise = cond_pred_noise + w * (cond_pred_noise - uncond_pred_noise)
                x_prev = solver.ddim_step(pred_x0, pred_noise, index)

        with torch.no_grad():
            with autocast_ctx:
                target_noise_pred = unet(
                    x_prev.float(),
                    timesteps,
                    timestep_cond=None,
                    encoder_hidden_states=prompt_embeds.float(),
                ).sample
            pred_x_0 = get_predicted_original_sample(
                target_noise_pred,
                timesteps,
                x_prev,
                noise_scheduler.config.prediction_type,
                alpha_schedule,
                sigma_schedule,
            )
            target = c_skip * x_prev + c_out * pred_x_0

        if args.loss_type == "l2":
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        elif args.loss_type == "huber":
            loss = torch.mean(
                torch.sqrt((model_pred.float() - target.float()) ** 2 + args.huber_c**2)
                - args.huber_c
            )
        return loss

    return types.SimpleNamespace(step=training_step, unet=unet)


def _batch(size: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    image = torch.rand(size, 3, 32, 32, generator=generator) * 2 - 1
    return (image, [CAPTIONS[(seed + i) % len(CAPTIONS)] for i in range(size)])


def test_an_image_text_tuple_batch_is_cut_per_item_by_the_module_level_probe():
    """A webdataset batch ``(image, text)`` of two samples is a 2-tuple: the probe that runs
    the last sample alone must cut each item, not take the tuple for a per-sample list."""
    encoder = torch.nn.Linear(8, 4).requires_grad_(False)
    head = torch.nn.Linear(4, 1)

    def training_step(batch):
        image, text = batch
        return head(encoder(image)).mean() * len(text)

    batch = (torch.randn(2, 8), ["a red circle", "a blue square"])
    split = split_and_verify(training_step, (batch,), path="calls")
    assert stage2_top_modules(split) == {"head"}


@pytest.mark.slow
def test_lcm_distillation_caches_vae_and_text_encoder_and_verifies_exactly(tmp_path):
    parts = build()
    split = split_and_verify(parts.step, (_batch(),))
    assert split.path == "calls"
    assert "tuple" in split.reason  # the trace refuses the (image, text) batch on purpose
    cached = {v.path for v in split.plan.verdicts if v.cached}
    assert {"text_encoder", "vae.encoder", "vae.quant_conv"} <= cached
    assert "teacher_unet" not in cached  # fed the noisy latents: a draw
    held = stage2_top_modules(split)
    assert {"unet", "teacher_unet"} <= held and "text_encoder" not in held
    names = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith(("text_encoder.", "vae.")) for name in names)
    assert "vae" not in held  # its encoder is cached, its decoder never runs in the step
    assert {"text_encoder__0__last_hidden_state", "vae_quant_conv__0__out"} <= set(split.boundary)
    assert not any(key.startswith("vae_encoder") for key in split.boundary)  # read by quant_conv
    # The (image, text) tuple crosses item by item, the captions as their code points.
    assert {"batch__0", "batch__1"} <= set(split.boundary)
    # graphsplit.cache counts a batch's samples by a batched tensor among its inputs, or its keys.
    loader = [{"batch": _batch(2, seed), "key": [f"{seed}/0", f"{seed}/1"]} for seed in (1, 2)]
    assert_cache_round_trip(
        split,
        parts.step,
        loader,
        tmp_path,
        parts.unet,
        rows_per_batch=2,
        call=lambda step, raw: step(raw["batch"]),
    )


@pytest.mark.slow
def test_lcm_at_another_batch_size_than_train_batch_size_is_refused_by_the_step_itself():
    """The step binds ``uncond_prompt_embeds`` to ``train_batch_size``: at another size the
    teacher's call fails, and the split says the step raised, not a verdict."""
    parts = build(train_batch_size=2)
    with pytest.raises(graphsplit.SplitError, match="the step raised"):
        graphsplit.split(parts.step, (_batch(3),), path="calls")
