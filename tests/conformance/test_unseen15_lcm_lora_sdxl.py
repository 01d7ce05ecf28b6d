"""Conformance: ``examples/consistency_distillation/train_lcm_distill_lora_sdxl.py``'s loop body.

huggingface/diffusers ``examples/consistency_distillation/train_lcm_distill_lora_sdxl.py``
(commit 58eb52c): LCM-LoRA distillation of SDXL. One UNet is student, teacher and target: peft
LoRA added by ``unet.add_adapter`` on the script's default target modules (attention, ff,
resnet convolutions, ``time_emb_proj``, down/upsamplers); the teacher's conditional and
unconditional passes run under ``torch.no_grad()`` with ``disable_adapters()`` (the frozen base
weights), then ``enable_adapters()`` and the target pass under ``torch.no_grad()`` on the DDIM
solver's ``x_prev``. The guidance scale ``w`` is drawn with ``torch.rand`` (no guidance
embedding, LCM-LoRA), the timesteps from the DDIM solver's schedule. ``DDIMSolver``,
``append_dims``, ``scalings_for_boundary_conditions``, ``get_predicted_original_sample``,
``get_predicted_noise``, ``extract_into_tensor``, ``encode_prompt``, ``collate_fn`` and
``compute_embeddings`` (with its ``compute_time_ids``) are verbatim, and so is the loop body
(``--loss_type huber``, as the LCM-LoRA README runs it); ``accelerator`` reads the CPU and
unwraps to the module itself; ``accelerator.backward`` and the optimizer lines are the caller's.

What must hold: the step splits exactly (loss and every LoRA gradient bit for bit, on the
example, on a batch of another size and on one of another resolution: 32 x 32 then 32 x 48
px), the two CLIP text encoders' outputs and the VAE's latent distribution are cached and
neither is held by stage 2, the teacher passes (the same UNet with its adapters off, on noisy
latents) stay in stage 2, and a cache of a loader of mixed resolutions written through the disk
trains stage 2 exactly, batched by ``CachedDataset.loader`` one bucket a batch.

Tiny configs: diffusers' SDXL pipeline-test components (``unseen9_a_checks``), LoRA rank 4.
"""

from __future__ import annotations

import copy
import functools
import random
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.conformance.unseen2_data_checks import assert_same_step  # noqa: E402
from tests.conformance.unseen9_a_checks import sdxl_components, sdxl_tokenizer  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules  # noqa: E402

WORDS = [
    "a",
    "photo",
    "of",
    "sks",
    "dog",
    "cat",
    "in",
    "the",
    "snow",
    "on",
    "beach",
    "red",
    "blue",
    "naruto",
]
CAPTIONS = [
    "a photo of a dog",
    "naruto in the snow",
    "a red cat on the beach",
    "a blue dog",
    "sks cat in the snow",
    "a photo of naruto",
]
RESOLUTION = 32


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The script's module-level helpers, verbatim.
class DDIMSolver:
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

    def to(self, device):
        self.ddim_timesteps = self.ddim_timesteps.to(device)
        self.ddim_alpha_cumprods = self.ddim_alpha_cumprods.to(device)
        self.ddim_alpha_cumprods_prev = self.ddim_alpha_cumprods_prev.to(device)
        return self

    def ddim_step(self, pred_x0, pred_noise, timestep_index):
        alpha_cumprod_prev = extract_into_tensor(
            self.ddim_alpha_cumprods_prev, timestep_index, pred_x0.shape
        )
        dir_xt = (1.0 - alpha_cumprod_prev).sqrt() * pred_noise
        x_prev = alpha_cumprod_prev.sqrt() * pred_x0 + dir_xt
        return x_prev


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
        raise ValueError(
            f"Prediction type {prediction_type} is not supported; currently, `epsilon`, "
            f"`sample`, and `v_prediction` are supported."
        )

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
        raise ValueError(
            f"Prediction type {prediction_type} is not supported; currently, `epsilon`, "
            f"`sample`, and `v_prediction` are supported."
        )

    return pred_epsilon


def extract_into_tensor(a, t, x_shape):
    b, *_ = t.shape
    out = a.gather(-1, t)
    return out.reshape(b, *((1,) * (len(x_shape) - 1)))


def encode_prompt(prompt_batch, text_encoders, tokenizers, is_train=True):
    prompt_embeds_list = []

    captions = []
    for caption in prompt_batch:
        if isinstance(caption, str):
            captions.append(caption)
        elif isinstance(caption, (list, np.ndarray)):
            # take a random caption if there are multiple
            captions.append(random.choice(caption) if is_train else caption[0])

    with torch.no_grad():
        for tokenizer, text_encoder in zip(tokenizers, text_encoders):
            text_inputs = tokenizer(
                captions,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            )
            text_input_ids = text_inputs.input_ids
            prompt_embeds = text_encoder(
                text_input_ids.to(text_encoder.device),
                output_hidden_states=True,
            )

            # We are only ALWAYS interested in the pooled output of the final text encoder
            pooled_prompt_embeds = prompt_embeds[0]
            prompt_embeds = prompt_embeds.hidden_states[-2]
            bs_embed, seq_len, _ = prompt_embeds.shape
            prompt_embeds = prompt_embeds.view(bs_embed, seq_len, -1)
            prompt_embeds_list.append(prompt_embeds)

    prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
    pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)
    return prompt_embeds, pooled_prompt_embeds


def collate_fn(examples):
    """``main()``'s, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    original_sizes = [example["original_sizes"] for example in examples]
    crop_top_lefts = [example["crop_top_lefts"] for example in examples]
    captions = [example["captions"] for example in examples]

    return {
        "pixel_values": pixel_values,
        "captions": captions,
        "original_sizes": original_sizes,
        "crop_top_lefts": crop_top_lefts,
    }


def _example(index: int, height: int = RESOLUTION, width: int = RESOLUTION) -> dict:
    """``preprocess_train``'s output for one image: [-1, 1] pixels, its size before the
    resize, its crop corner and its caption."""
    generator = torch.Generator().manual_seed(300 + index)
    return {
        "pixel_values": torch.rand(3, height, width, generator=generator) * 2 - 1,
        "original_sizes": (height * 2 + index, width * 2),
        "crop_top_lefts": (index % 3, 0),
        "captions": CAPTIONS[index % len(CAPTIONS)],
    }


def _batch(first: int, size: int, height: int = RESOLUTION, width: int = RESOLUTION) -> dict:
    return collate_fn([_example(i, height, width) for i in range(first, first + size)])


def build(vae_encode_batch_size: int = 8):
    """``main()``'s models, solver and schedules, ``compute_embeddings_fn``, and the loop body
    (``--vae_encode_batch_size``: the script's default 8, or smaller than the batch)."""
    parts = sdxl_components(vocab_size=len(WORDS) + 3)
    unet, vae = parts.unet, parts.vae
    text_encoder_one, text_encoder_two = parts.text_encoder_one, parts.text_encoder_two
    tokenizer_one, tokenizer_two = sdxl_tokenizer(WORDS), sdxl_tokenizer(WORDS)
    noise_scheduler = parts.noise_scheduler
    args = types.SimpleNamespace(
        resolution=RESOLUTION,
        num_ddim_timesteps=50,
        w_min=3.0,
        w_max=15.0,
        timestep_scaling_factor=10.0,
        vae_encode_batch_size=vae_encode_batch_size,
        pretrained_vae_model_name_or_path=None,
        loss_type="huber",
        huber_c=0.001,
        lora_rank=4,
        lora_alpha=4,
        lora_dropout=0.0,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m)
    weight_dtype = torch.float32

    # DDPMScheduler calculates the alpha and sigma noise schedules (based on the alpha bars)
    alpha_schedule = torch.sqrt(noise_scheduler.alphas_cumprod)
    sigma_schedule = torch.sqrt(1 - noise_scheduler.alphas_cumprod)
    # Initialize the DDIM ODE solver for distillation.
    solver = DDIMSolver(
        noise_scheduler.alphas_cumprod.numpy(),
        timesteps=noise_scheduler.config.num_train_timesteps,
        ddim_timesteps=args.num_ddim_timesteps,
    )

    # 6. Freeze teacher vae, text_encoders.
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    unet.requires_grad_(False)

    # 9. Add LoRA to the student U-Net, only the LoRA projection matrix will be updated.
    lora_target_modules = [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "proj_in",
        "proj_out",
        "ff.net.0.proj",
        "ff.net.2",
        "conv1",
        "conv2",
        "conv_shortcut",
        "downsamplers.0.conv",
        "upsamplers.0.conv",
        "time_emb_proj",
    ]
    lora_config = peft.LoraConfig(
        r=args.lora_rank,
        target_modules=lora_target_modules,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
    )
    unet.add_adapter(lora_config)
    # lora_B starts at zero: drawn small so that the student differs from the teacher.
    generator = torch.Generator().manual_seed(5)
    for name, param in unet.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02

    alpha_schedule = alpha_schedule.to(accelerator.device)
    sigma_schedule = sigma_schedule.to(accelerator.device)
    solver = solver.to(accelerator.device)

    # 14. Embeddings for the UNet.
    # Adapted from pipeline.StableDiffusionXLPipeline._get_add_time_ids
    def compute_embeddings(
        prompt_batch, original_sizes, crop_coords, text_encoders, tokenizers, is_train=True
    ):
        def compute_time_ids(original_size, crops_coords_top_left):
            target_size = (args.resolution, args.resolution)
            add_time_ids = list(original_size + crops_coords_top_left + target_size)
            add_time_ids = torch.tensor([add_time_ids])
            add_time_ids = add_time_ids.to(accelerator.device, dtype=weight_dtype)
            return add_time_ids

        prompt_embeds, pooled_prompt_embeds = encode_prompt(
            prompt_batch, text_encoders, tokenizers, is_train
        )
        add_text_embeds = pooled_prompt_embeds

        add_time_ids = torch.cat(
            [compute_time_ids(s, c) for s, c in zip(original_sizes, crop_coords)]
        )

        prompt_embeds = prompt_embeds.to(accelerator.device)
        add_text_embeds = add_text_embeds.to(accelerator.device)
        unet_added_cond_kwargs = {"text_embeds": add_text_embeds, "time_ids": add_time_ids}

        return {"prompt_embeds": prompt_embeds, **unet_added_cond_kwargs}

    text_encoders = [text_encoder_one, text_encoder_two]
    tokenizers = [tokenizer_one, tokenizer_two]

    compute_embeddings_fn = functools.partial(
        compute_embeddings, text_encoders=text_encoders, tokenizers=tokenizers
    )

    unet.train()

    def training_step(batch):
        # 1. Load and process the image and text conditioning
        pixel_values, text, orig_size, crop_coords = (
            batch["pixel_values"],
            batch["captions"],
            batch["original_sizes"],
            batch["crop_top_lefts"],
        )

        encoded_text = compute_embeddings_fn(text, orig_size, crop_coords)

        # encode pixel values with batch size of at most args.vae_encode_batch_size
        pixel_values = pixel_values.to(dtype=vae.dtype)
        latents = []
        for i in range(0, pixel_values.shape[0], args.vae_encode_batch_size):
            latents.append(
                vae.encode(pixel_values[i : i + args.vae_encode_batch_size]).latent_dist.sample()
            )
        latents = torch.cat(latents, dim=0)

        latents = latents * vae.config.scaling_factor
        if args.pretrained_vae_model_name_or_path is None:
            latents = latents.to(weight_dtype)

        # 2. Sample a random timestep for each image t_n from the ODE solver timesteps without
        # bias. For the DDIM solver, the timestep schedule is [T - 1, T - k - 1, T - 2 * k - 1, ...]
        bsz = latents.shape[0]
        topk = noise_scheduler.config.num_train_timesteps // args.num_ddim_timesteps
        index = torch.randint(0, args.num_ddim_timesteps, (bsz,), device=latents.device).long()
        start_timesteps = solver.ddim_timesteps[index]
        timesteps = start_timesteps - topk
        timesteps = torch.where(timesteps < 0, torch.zeros_like(timesteps), timesteps)

        # 3. Get boundary scalings for start_timesteps and (end) timesteps.
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

        # 4. Sample noise from the prior and add it to the latents according to the noise
        # magnitude at each timestep [z_{t_{n + k}} in Algorithm 1]
        noise = torch.randn_like(latents)
        noisy_model_input = noise_scheduler.add_noise(latents, noise, start_timesteps)

        # 5. Sample a random guidance scale w from U[w_min, w_max]
        # Note that for LCM-LoRA distillation it is not necessary to use a guidance scale embedding
        w = (args.w_max - args.w_min) * torch.rand((bsz,)) + args.w_min
        w = w.reshape(bsz, 1, 1, 1)
        w = w.to(device=latents.device, dtype=latents.dtype)

        # 6. Prepare prompt embeds and unet_added_conditions
        prompt_embeds = encoded_text.pop("prompt_embeds")

        # 7. Get online LCM prediction on z_{t_{n + k}} (noisy_model_input), w, c, t_{n + k}
        noise_pred = unet(
            noisy_model_input,
            start_timesteps,
            encoder_hidden_states=prompt_embeds,
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

        # 8. Compute the conditional and unconditional teacher model predictions.
        # With the adapters disabled, the `unet` is the regular teacher model.
        accelerator.unwrap_model(unet).disable_adapters()
        with torch.no_grad():
            # 1. Get teacher model prediction on noisy_model_input z_{t_{n + k}} and conditional
            # embedding c
            cond_teacher_output = unet(
                noisy_model_input,
                start_timesteps,
                encoder_hidden_states=prompt_embeds,
                added_cond_kwargs={k: v.to(weight_dtype) for k, v in encoded_text.items()},
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

            # 2. Get teacher model prediction on noisy_model_input z_{t_{n + k}} and
            # unconditional embedding 0
            uncond_prompt_embeds = torch.zeros_like(prompt_embeds)
            uncond_pooled_prompt_embeds = torch.zeros_like(encoded_text["text_embeds"])
            uncond_added_conditions = copy.deepcopy(encoded_text)
            uncond_added_conditions["text_embeds"] = uncond_pooled_prompt_embeds
            uncond_teacher_output = unet(
                noisy_model_input,
                start_timesteps,
                encoder_hidden_states=uncond_prompt_embeds.to(weight_dtype),
                added_cond_kwargs={
                    k: v.to(weight_dtype) for k, v in uncond_added_conditions.items()
                },
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

            # 3. Calculate the CFG estimate of x_0 (pred_x0) and eps_0 (pred_noise)
            pred_x0 = cond_pred_x0 + w * (cond_pred_x0 - uncond_pred_x0)
            pred_noise = cond_pred_noise + w * (cond_pred_noise - uncond_pred_noise)
            # 4. Run one step of the ODE solver to estimate the next point x_prev
            x_prev = solver.ddim_step(pred_x0, pred_noise, index).to(unet.dtype)

        # re-enable unet adapters to turn the `unet` into a student unet.
        accelerator.unwrap_model(unet).enable_adapters()

        # 9. Get target LCM prediction on x_prev, w, c, t_n (timesteps)
        # Note that we do not use a separate target network for LCM-LoRA distillation.
        with torch.no_grad():
            target_noise_pred = unet(
                x_prev,
                timesteps,
                encoder_hidden_states=prompt_embeds,
                added_cond_kwargs={k: v.to(weight_dtype) for k, v in encoded_text.items()},
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

        # 10. Calculate loss
        if args.loss_type == "l2":
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        elif args.loss_type == "huber":
            loss = torch.mean(
                torch.sqrt((model_pred.float() - target.float()) ** 2 + args.huber_c**2)
                - args.huber_c
            )
        return loss

    params = [p for p in unet.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        unet=unet,
        params=params,
        frozen=(vae, text_encoder_one, text_encoder_two),
    )


_BUILT: list = []


def _built():
    if not _BUILT:
        parts = build()
        _BUILT.append((parts, graphsplit.split(parts.step, (_batch(0, 2),))))
    return _BUILT[0]


def test_lcm_lora_sdxl_step_verifies_on_other_sizes_and_resolutions():
    parts, split = _built()
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(0, 2), _batch(2, 3), _batch(1, 2, 32, 48)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_lcm_lora_sdxl_caches_the_encoders_and_the_vae_not_the_teacher():
    parts, split = _built()
    assert "unet" in stage2_top_modules(split)
    frozen_params = {id(p) for module in parts.frozen for p in module.parameters()}
    assert not any(id(p) in frozen_params for p in split.stage2.parameters())
    trainable = {id(p) for p in split.stage2.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in parts.params}
    # The step tokenizes its captions, so the module-level path takes it.
    assert split.path == "calls"
    keys = set(split.boundary)
    assert "vae_quant_conv__0__out" in keys  # the latent distribution, resampled in stage 2
    assert {
        "text_encoders_0__0__hidden_states__1",
        "text_encoders_1__0__hidden_states__1",
        "text_encoders_1__0__text_embeds",
    } <= keys
    # The teacher is the trained UNet with its adapters off, on noisy latents: stage 2 runs
    # it (it holds the base weights); of the UNet only frozen layers fed by the text
    # conditioning alone are cached (cross-attention keys and values, the added embedding).
    held = {id(p) for p in split.stage2.parameters()}
    assert id(parts.unet.conv_in.weight) in held
    unet_keys = {key for key in keys if key.startswith("unet")}
    assert unet_keys and all("add_embedding" in key or "attn2" in key for key in unet_keys)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "the module-level path stores a frozen call's output once per call, not once per "
        "distinct value: the student, teacher (adapters off) and target passes of the one UNet "
        "run unet.add_embedding and every cross-attention to_k/to_v base layer on the same "
        "tensors, and graphsplit/calls/stored/__init__.py:storage (_sharing dedupes only "
        "fields of one call that are the very same tensor) gives each call its own boundary "
        "keys, so the cache holds three identical copies of each per sample"
    ),
)
def test_lcm_lora_sdxl_stores_a_repeated_frozen_call_once():
    """Calls of one frozen module on the same inputs (``prompt_embeds`` and
    ``encoded_text`` are the very tensors in the student, teacher and target passes) give the
    same output: the cache should store it once."""
    _parts, split = _built()
    rows = split.stage1(**_batch(0, 2))
    by_module: dict[str, list[torch.Tensor]] = {}
    for key, value in rows.items():
        if key.startswith("unet") and "__" in key:
            by_module.setdefault(key.rsplit("__", 2)[0], []).append(value)
    duplicated = [
        path
        for path, values in by_module.items()
        if any(torch.equal(a, b) for i, a in enumerate(values) for b in values[i + 1 :])
    ]
    assert not duplicated, duplicated


def test_lcm_lora_sdxl_cache_of_mixed_resolutions_trains_stage2(tmp_path):
    """A loader of two resolutions (aspect-ratio buckets, batches of 2), cached through the
    disk: each raw batch's rows train stage 2 as the unsplit step trains on the raw batch, and
    ``CachedDataset.loader`` batches the cache one bucket a batch with no bucket loop."""
    parts, split = _built()
    loader = [_batch(0, 2), _batch(2, 2, 32, 48), _batch(4, 2), _batch(6, 2, 32, 48)]
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    data = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(data) == 8
    assert len(data.buckets()) == 2
    row = 0
    for seed, raw in enumerate(loader):
        size = len(raw["captions"])
        rows = [data[row + offset] for offset in range(size)]
        row += size
        assert_same_step(
            lambda raw=raw: parts.step(raw),
            lambda rows=rows: split.stage2(**graphsplit.collate(rows)),
            parts.params,
            seed,
        )
    shuffled = data.loader(batch_size=2, seed=0)
    assert len(shuffled) == 4
    for batch in shuffled:
        split.stage2(**batch).backward()
    for param in parts.params:
        param.grad = None


def _chunked():
    """The README's ``--train_batch_size=12`` with the default ``--vae_encode_batch_size=8``
    encodes each batch in two VAE calls (8 rows, then 4); here a batch of 3 in chunks of 2."""
    parts = build(vae_encode_batch_size=2)
    return parts, graphsplit.split(parts.step, (_batch(0, 3),))


_CHUNKED: list = []


def _chunked_built():
    if not _CHUNKED:
        _CHUNKED.append(_chunked())
    return _CHUNKED[0]


def test_lcm_lora_sdxl_vae_in_chunks_verifies():
    parts, split = _chunked_built()
    for seed, batch in enumerate([_batch(0, 3), _batch(3, 2), _batch(1, 5, 32, 48)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.xfail(
    strict=True,
    reason=(
        "a frozen call on a row chunk of the batch is not cached: "
        "graphsplit/calls/analysis.py:judge takes a call as per sample only when an input "
        "leads with the batch's size (is_batched); vae.encode(pixel_values[i : i + "
        "args.vae_encode_batch_size]) leads with the chunk's, so each VAE call is judged an "
        "unbatched call whose input changes with the sample (Verdict.NOT_PER_SAMPLE, whose "
        "text says 'an output has no batch dimension first' with no fix), the VAE stays in "
        "stage 2 and the raw pixels are stored instead of the latent distribution"
    ),
)
def test_lcm_lora_sdxl_vae_in_chunks_is_cached():
    parts, split = _chunked_built()
    vae = parts.frozen[0]
    held = {id(p) for p in split.stage2.parameters()}
    assert not any(id(p) in held for p in vae.encoder.parameters())
    assert any(key.startswith("vae") for key in split.boundary), sorted(split.boundary)
