"""Conformance: the scheduled-Huber SDXL LoRA script's loop body, min-SNR and offset noise on.

huggingface/diffusers
``examples/research_projects/scheduled_huber_loss_training/text_to_image/train_text_to_image_lora_sdxl.py``
(commit 58eb52c): SDXL's UNet frozen with peft LoRA on ``to_k/to_q/to_v/to_out.0``
(``unet.add_adapter``, ``init_lora_weights="gaussian"``), the VAE and both CLIP text encoders
frozen (``--train_text_encoder`` off); the captions are tokenized in ``preprocess_train`` and
the step encodes ``input_ids_one`` / ``input_ids_two`` with the script's ``encode_prompt``.
Options on: ``--loss_type huber --huber_schedule snr`` (one timestep drawn for the batch,
``timesteps.item()`` turned into the Python float ``huber_c`` through ``alphas_cumprod``, the
timestep repeated over the batch), ``--noise_offset 0.05``, ``--snr_gamma 5.0``
(``compute_snr`` min-SNR weights on the per-sample Huber loss). ``tokenize_prompt``,
``encode_prompt``, ``conditional_loss`` and ``collate_fn`` are verbatim, and so is the loop body
(the loss gathered for logging and ``train_loss`` included); ``accelerator`` reads the CPU and
its ``gather`` is the one-process identity; ``accelerator.backward`` and the optimizer lines
are the caller's.

What must hold: the step splits exactly (loss and every LoRA gradient bit for bit, on the
example, on a batch of another size and on one of another resolution, 32 x 32 then 32 x 48
px), the text encoders' embeddings and the VAE's latent distribution are cached and neither
module is held by stage 2, every random draw (VAE sample, noise, offset noise, the timestep
whose value sets ``huber_c``) stays in stage 2, and a cache of a loader of mixed resolutions
written through the disk trains stage 2 exactly, batched by ``CachedDataset.loader``.

Tiny configs: diffusers' SDXL pipeline-test components (``unseen9_a_checks``), LoRA rank 4.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from diffusers.training_utils import compute_snr  # noqa: E402

from tests.conformance.unseen2_data_checks import assert_same_step  # noqa: E402
from tests.conformance.unseen9_a_checks import sdxl_components, sdxl_tokenizer  # noqa: E402

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
    "pokemon",
]
CAPTIONS = [
    "a photo of a dog",
    "pokemon in the snow",
    "a red cat on the beach",
    "a blue dog",
    "sks cat in the snow",
    "a photo of pokemon",
]
RESOLUTION = 32


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The script's module-level helpers, verbatim.
def tokenize_prompt(tokenizer, prompt):
    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    )
    text_input_ids = text_inputs.input_ids
    return text_input_ids


# Adapted from pipelines.StableDiffusionXLPipeline.encode_prompt
def encode_prompt(text_encoders, tokenizers, prompt, text_input_ids_list=None):
    prompt_embeds_list = []

    for i, text_encoder in enumerate(text_encoders):
        if tokenizers is not None:
            tokenizer = tokenizers[i]
            text_input_ids = tokenize_prompt(tokenizer, prompt)
        else:
            assert text_input_ids_list is not None
            text_input_ids = text_input_ids_list[i]

        prompt_embeds = text_encoder(
            text_input_ids.to(text_encoder.device), output_hidden_states=True, return_dict=False
        )

        # We are only ALWAYS interested in the pooled output of the final text encoder
        pooled_prompt_embeds = prompt_embeds[0]
        prompt_embeds = prompt_embeds[-1][-2]
        bs_embed, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.view(bs_embed, seq_len, -1)
        prompt_embeds_list.append(prompt_embeds)

    prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
    pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)
    return prompt_embeds, pooled_prompt_embeds


# NOTE: if you're using the scheduled version, huber_c has to depend on the timesteps already
def conditional_loss(
    model_pred: torch.Tensor,
    target: torch.Tensor,
    reduction: str = "mean",
    loss_type: str = "l2",
    huber_c: float = 0.1,
):
    if loss_type == "l2":
        loss = F.mse_loss(model_pred, target, reduction=reduction)
    elif loss_type == "huber" or loss_type == "huber_scheduled":
        loss = huber_c * (torch.sqrt((model_pred - target) ** 2 + huber_c**2) - huber_c)
        if reduction == "mean":
            loss = torch.mean(loss)
        elif reduction == "sum":
            loss = torch.sum(loss)
    else:
        raise NotImplementedError(f"Unsupported Loss Type {loss_type}")
    return loss


def collate_fn(examples):
    """``main()``'s, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    original_sizes = [example["original_sizes"] for example in examples]
    crop_top_lefts = [example["crop_top_lefts"] for example in examples]
    input_ids_one = torch.stack([example["input_ids_one"] for example in examples])
    input_ids_two = torch.stack([example["input_ids_two"] for example in examples])
    result = {
        "pixel_values": pixel_values,
        "input_ids_one": input_ids_one,
        "input_ids_two": input_ids_two,
        "original_sizes": original_sizes,
        "crop_top_lefts": crop_top_lefts,
    }

    filenames = [example["filenames"] for example in examples if "filenames" in example]
    if filenames:
        result["filenames"] = filenames
    return result


TOKENIZERS = (sdxl_tokenizer(WORDS), sdxl_tokenizer(WORDS))


def _example(index: int, height: int = RESOLUTION, width: int = RESOLUTION) -> dict:
    """``preprocess_train``'s output for one image: [-1, 1] pixels, its size before the
    resize, its crop corner, and its caption tokenized by both tokenizers."""
    generator = torch.Generator().manual_seed(900 + index)
    caption = CAPTIONS[index % len(CAPTIONS)]
    return {
        "pixel_values": torch.rand(3, height, width, generator=generator) * 2 - 1,
        "original_sizes": (height * 2 + index, width * 2),
        "crop_top_lefts": (index % 3, 0),
        "input_ids_one": tokenize_prompt(TOKENIZERS[0], [caption])[0],
        "input_ids_two": tokenize_prompt(TOKENIZERS[1], [caption])[0],
    }


def _batch(first: int, size: int, height: int = RESOLUTION, width: int = RESOLUTION) -> dict:
    return collate_fn([_example(i, height, width) for i in range(first, first + size)])


def build():
    """``main()``'s models and LoRA, and the loop body."""
    parts = sdxl_components(vocab_size=len(WORDS) + 3)
    unet, vae = parts.unet, parts.vae
    text_encoder_one, text_encoder_two = parts.text_encoder_one, parts.text_encoder_two
    noise_scheduler = parts.noise_scheduler
    args = types.SimpleNamespace(
        resolution=RESOLUTION,
        pretrained_vae_model_name_or_path=None,
        noise_offset=0.05,
        loss_type="huber",
        huber_schedule="snr",
        huber_c=0.1,
        prediction_type=None,
        snr_gamma=5.0,
        rank=4,
        train_text_encoder=False,
        debug_loss=False,
        train_batch_size=2,
        gradient_accumulation_steps=1,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t)
    weight_dtype = torch.float32

    # We only train the additional adapter LoRA layers
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    unet.requires_grad_(False)

    # now we will add new LoRA weights to the attention layers
    # Set correct lora layers
    unet_lora_config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        init_lora_weights="gaussian",
        target_modules=["to_k", "to_q", "to_v", "to_out.0"],
    )
    torch.manual_seed(7)
    unet.add_adapter(unet_lora_config)
    unet.train()
    logged = {"train_loss": 0.0}

    def training_step(batch):
        # Convert images to latent space
        if args.pretrained_vae_model_name_or_path is not None:
            pixel_values = batch["pixel_values"].to(dtype=weight_dtype)
        else:
            pixel_values = batch["pixel_values"]

        model_input = vae.encode(pixel_values).latent_dist.sample()
        model_input = model_input * vae.config.scaling_factor
        if args.pretrained_vae_model_name_or_path is None:
            model_input = model_input.to(weight_dtype)

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(model_input)
        if args.noise_offset:
            # https://www.crosslabs.org//blog/diffusion-with-offset-noise
            noise += args.noise_offset * torch.randn(
                (model_input.shape[0], model_input.shape[1], 1, 1), device=model_input.device
            )

        bsz = model_input.shape[0]
        # Sample a random timestep for each image
        if args.loss_type == "huber" or args.loss_type == "smooth_l1":
            timesteps = torch.randint(
                0, noise_scheduler.config.num_train_timesteps, (1,), device="cpu"
            )
            timestep = timesteps.item()

            if args.huber_schedule == "exponential":
                alpha = -math.log(args.huber_c) / noise_scheduler.config.num_train_timesteps
                huber_c = math.exp(-alpha * timestep)
            elif args.huber_schedule == "snr":
                alphas_cumprod = noise_scheduler.alphas_cumprod[timestep]
                sigmas = ((1.0 - alphas_cumprod) / alphas_cumprod) ** 0.5
                huber_c = (1 - args.huber_c) / (1 + sigmas) ** 2 + args.huber_c
            elif args.huber_schedule == "constant":
                huber_c = args.huber_c
            else:
                raise NotImplementedError(f"Unknown Huber loss schedule {args.huber_schedule}!")

            timesteps = timesteps.repeat(bsz).to(model_input.device)
        elif args.loss_type == "l2":
            timesteps = torch.randint(
                0, noise_scheduler.config.num_train_timesteps, (bsz,), device=model_input.device
            )
            huber_c = 1  # may be anything, as it's not used
        else:
            raise NotImplementedError(f"Unknown loss type {args.loss_type}")

        timesteps = timesteps.long()

        # Add noise to the model input according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps)

        # time ids
        def compute_time_ids(original_size, crops_coords_top_left):
            # Adapted from pipeline.StableDiffusionXLPipeline._get_add_time_ids
            target_size = (args.resolution, args.resolution)
            add_time_ids = list(original_size + crops_coords_top_left + target_size)
            add_time_ids = torch.tensor([add_time_ids])
            add_time_ids = add_time_ids.to(accelerator.device, dtype=weight_dtype)
            return add_time_ids

        add_time_ids = torch.cat(
            [
                compute_time_ids(s, c)
                for s, c in zip(batch["original_sizes"], batch["crop_top_lefts"])
            ]
        )

        # Predict the noise residual
        unet_added_conditions = {"time_ids": add_time_ids}
        prompt_embeds, pooled_prompt_embeds = encode_prompt(
            text_encoders=[text_encoder_one, text_encoder_two],
            tokenizers=None,
            prompt=None,
            text_input_ids_list=[batch["input_ids_one"], batch["input_ids_two"]],
        )
        unet_added_conditions.update({"text_embeds": pooled_prompt_embeds})
        model_pred = unet(
            noisy_model_input,
            timesteps,
            prompt_embeds,
            added_cond_kwargs=unet_added_conditions,
            return_dict=False,
        )[0]

        # Get the target for loss depending on the prediction type
        if args.prediction_type is not None:
            # set prediction_type of scheduler if defined
            noise_scheduler.register_to_config(prediction_type=args.prediction_type)

        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(model_input, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        if args.snr_gamma is None:
            loss = conditional_loss(
                model_pred.float(),
                target.float(),
                reduction="mean",
                loss_type=args.loss_type,
                huber_c=huber_c,
            )
        else:
            # Compute loss-weights as per Section 3.4 of https://huggingface.co/papers/2303.09556.
            # Since we predict the noise instead of x_0, the original formulation is slightly
            # changed. This is discussed in Section 4.2 of the same paper.
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack(
                [snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1
            ).min(dim=1)[0]
            if noise_scheduler.config.prediction_type == "epsilon":
                mse_loss_weights = mse_loss_weights / snr
            elif noise_scheduler.config.prediction_type == "v_prediction":
                mse_loss_weights = mse_loss_weights / (snr + 1)

            loss = conditional_loss(
                model_pred.float(),
                target.float(),
                reduction="none",
                loss_type=args.loss_type,
                huber_c=huber_c,
            )
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()
        # Gather the losses across all processes for logging (if we use distributed training).
        avg_loss = accelerator.gather(loss.repeat(args.train_batch_size)).mean()
        logged["train_loss"] += avg_loss.item() / args.gradient_accumulation_steps
        return loss

    params = [p for p in unet.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        unet=unet,
        params=params,
        frozen=(vae, text_encoder_one, text_encoder_two),
        logged=logged,
    )


_BUILT: list = []


def _built():
    if not _BUILT:
        parts = build()
        _BUILT.append((parts, graphsplit.split(parts.step, (_batch(0, 2),))))
    return _BUILT[0]


def test_huber_sdxl_step_verifies_on_other_sizes_and_resolutions():
    parts, split = _built()
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(0, 2), _batch(2, 3), _batch(1, 2, 32, 48)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_huber_sdxl_caches_the_encoders_and_the_vae():
    parts, split = _built()
    frozen_params = {id(p) for module in parts.frozen for p in module.parameters()}
    assert not any(id(p) in frozen_params for p in split.stage2.parameters())
    trainable = {id(p) for p in split.stage2.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in parts.params}
    # ``timesteps.item()`` (the draw that sets ``huber_c``) stops the whole-step trace; the
    # report names the line, and the module-level path takes the step as it is.
    assert split.path == "calls"
    report = split.report()
    assert "timestep = timesteps.item()" in report
    keys = set(split.boundary)
    # The VAE's latent distribution (the sample is drawn in stage 2), the text embeddings.
    assert any(key.startswith("vae") for key in keys), keys
    assert any("text_encoder_one" in key for key in keys), keys
    assert any("text_encoder_two" in key for key in keys), keys
    assert "vae" in report and "text_encoder_one" in report


def test_huber_sdxl_cache_of_mixed_resolutions_trains_stage2(tmp_path):
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
        size = len(raw["input_ids_one"])
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
