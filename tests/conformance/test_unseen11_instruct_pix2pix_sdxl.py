"""Conformance: ``examples/instruct_pix2pix/train_instruct_pix2pix_sdxl.py``'s loop body.

The whole SDXL UNet trains (full fine-tuning, no LoRA), its ``conv_in`` widened to 8 channels
as ``main()`` widens it (the extra input channels zero-initialised); the VAE and both CLIP text
encoders are frozen. As in the script, the text encoders run in the dataset's
``preprocess_train`` (``compute_embeddings_for_prompts``: its ``encode_prompt`` /
``encode_prompts``, copied verbatim), so the batch its ``collate_fn`` (verbatim) makes carries
``prompt_embeds`` and ``add_text_embeds``; ``null_conditioning`` (the empty prompt through both
encoders) and ``add_time_ids`` (``compute_time_ids``: one row per ``--train_batch_size``) are
computed once before the loop. The loop body is copied from the script
(``--pretrained_vae_model_name_or_path`` unset, ``--vae_precision=fp32``,
``--conditioning_dropout_prob=0.05`` as its README runs it): *both* images VAE-encoded with
``latent_dist.sample()`` (the edited image's latents and the original image's embedding), DDPM
noise and timesteps, ``add_noise``, the conditioning dropout drawn from the script's own
``torch.Generator`` (``torch.rand(bsz, generator=generator)``), ``torch.where`` against the
null conditioning, the image mask, the channel concat, the SDXL ``added_cond_kwargs`` and the
MSE loss.

What must hold: the step splits exactly (the loss and every UNet gradient bit for bit); the
VAE's work on both images is cached (stage 2 holds no VAE weight) while both samples, the noise,
the timesteps and the generator's draw happen in stage 2 in the step's order; a cache written
through the disk trains stage 2 step after step as the unsplit script trains, consuming the
script's generator alike.

``add_time_ids`` has ``--train_batch_size`` rows, so the script's own step runs at that batch
size only (a smaller last batch fails in the UNet's ``add_embedding`` unsplit too): the other
size is checked with the script built for it (``--train_batch_size=3``).

Tiny configs: diffusers' SDXL pipeline-test components (``unseen9_a_checks``), 32 px.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen9_a_checks import (  # noqa: E402
    RESOLUTION,
    sdxl_components,
    sdxl_tokenizer,
)
from tests.conformance.unseen11_b_checks import one_thread, trainable_names  # noqa: E402
from tests.conformance.unseen_checks import loss_and_grads, stage2_top_modules  # noqa: E402

_one_thread = pytest.fixture(autouse=True)(one_thread)

logger = logging.getLogger(__name__)

WORDS = ["make", "it", "a", "snowy", "winter", "scene", "turn", "the", "sky", "red", "add"]
EDITS = ["make it a snowy winter scene", "turn the sky red", "add a red sky", "make it red"]


def build(*, train_batch_size: int = 2, conditioning_dropout_prob=0.05, seed: int = 42):
    """``main()``'s models and closures (fp32, one process) and the loop body."""
    components = sdxl_components(len(WORDS) + 3)
    vae, unet = components.vae, components.unet
    text_encoder_1, text_encoder_2 = components.text_encoder_one, components.text_encoder_two
    tokenizer_1, tokenizer_2 = sdxl_tokenizer(WORDS), sdxl_tokenizer(WORDS)
    noise_scheduler = components.noise_scheduler
    args = types.SimpleNamespace(
        pretrained_vae_model_name_or_path=None,
        resolution=RESOLUTION,
        crops_coords_top_left_h=0,
        crops_coords_top_left_w=0,
        train_batch_size=train_batch_size,
        conditioning_dropout_prob=conditioning_dropout_prob,
        seed=seed,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    weight_dtype = torch.float32
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed)

    # InstructPix2Pix uses an additional image for conditioning. To accommodate that,
    # it uses 8 channels (instead of 4) in the first (conv) layer of the UNet. This UNet is
    # then fine-tuned on the custom InstructPix2Pix dataset. This modified UNet is initialized
    # from the pre-trained checkpoints. For the extra channels added to the first layer, they
    # are initialized to zero.
    in_channels = 8
    out_channels = unet.conv_in.out_channels
    unet.register_to_config(in_channels=in_channels)

    with torch.no_grad():
        new_conv_in = nn.Conv2d(
            in_channels,
            out_channels,
            unet.conv_in.kernel_size,
            unet.conv_in.stride,
            unet.conv_in.padding,
        )
        new_conv_in.weight.zero_()
        new_conv_in.weight[:, :4, :, :].copy_(unet.conv_in.weight)
        unet.conv_in = new_conv_in

    def tokenize_captions(captions, tokenizer):
        inputs = tokenizer(
            captions,
            max_length=tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )
        return inputs.input_ids

    tokenizers = [tokenizer_1, tokenizer_2]
    text_encoders = [text_encoder_1, text_encoder_2]

    # Freeze vae and text_encoders
    vae.requires_grad_(False)
    text_encoder_1.requires_grad_(False)
    text_encoder_2.requires_grad_(False)

    # Set UNet to trainable.
    unet.train()

    # Adapted from pipelines.StableDiffusionXLPipeline.encode_prompt
    def encode_prompt(text_encoders, tokenizers, prompt):
        prompt_embeds_list = []

        for tokenizer, text_encoder in zip(tokenizers, text_encoders):
            text_inputs = tokenizer(
                prompt,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            )
            text_input_ids = text_inputs.input_ids
            untruncated_ids = tokenizer(prompt, padding="longest", return_tensors="pt").input_ids

            if untruncated_ids.shape[-1] >= text_input_ids.shape[-1] and not torch.equal(
                text_input_ids, untruncated_ids
            ):
                removed_text = tokenizer.batch_decode(
                    untruncated_ids[:, tokenizer.model_max_length - 1 : -1]
                )
                logger.warning(
                    "The following part of your input was truncated because CLIP can only handle"
                    f" sequences up to {tokenizer.model_max_length} tokens: {removed_text}"
                )

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

    # Adapted from pipelines.StableDiffusionXLPipeline.encode_prompt
    def encode_prompts(text_encoders, tokenizers, prompts):
        prompt_embeds_all = []
        pooled_prompt_embeds_all = []

        for prompt in prompts:
            prompt_embeds, pooled_prompt_embeds = encode_prompt(text_encoders, tokenizers, prompt)
            prompt_embeds_all.append(prompt_embeds)
            pooled_prompt_embeds_all.append(pooled_prompt_embeds)

        return torch.stack(prompt_embeds_all), torch.stack(pooled_prompt_embeds_all)

    # Adapted from examples.dreambooth.train_dreambooth_lora_sdxl
    # Here, we compute not just the text embeddings but also the additional embeddings
    # needed for the SD XL UNet to operate.
    def compute_embeddings_for_prompts(prompts, text_encoders, tokenizers):
        with torch.no_grad():
            prompt_embeds_all, pooled_prompt_embeds_all = encode_prompts(
                text_encoders, tokenizers, prompts
            )
            add_text_embeds_all = pooled_prompt_embeds_all

            prompt_embeds_all = prompt_embeds_all.to(accelerator.device)
            add_text_embeds_all = add_text_embeds_all.to(accelerator.device)
        return prompt_embeds_all, add_text_embeds_all

    # Get null conditioning
    def compute_null_conditioning():
        null_conditioning_list = []
        for a_tokenizer, a_text_encoder in zip(tokenizers, text_encoders):
            null_conditioning_list.append(
                a_text_encoder(
                    tokenize_captions([""], tokenizer=a_tokenizer).to(accelerator.device),
                    output_hidden_states=True,
                ).hidden_states[-2]
            )
        return torch.concat(null_conditioning_list, dim=-1)

    null_conditioning = compute_null_conditioning()

    def compute_time_ids():
        crops_coords_top_left = (args.crops_coords_top_left_h, args.crops_coords_top_left_w)
        original_size = target_size = (args.resolution, args.resolution)
        add_time_ids = list(original_size + crops_coords_top_left + target_size)
        add_time_ids = torch.tensor([add_time_ids], dtype=weight_dtype)
        return add_time_ids.to(accelerator.device).repeat(args.train_batch_size, 1)

    add_time_ids = compute_time_ids()

    def preprocess_train(examples):
        """The script's, less ``preprocess_images`` (the rows carry the images already in
        [-1, 1], as its ``2 * (images / 255) - 1`` leaves them)."""
        examples = dict(examples)
        # Preprocess the captions.
        captions = list(examples["edit_prompt"])
        prompt_embeds_all, add_text_embeds_all = compute_embeddings_for_prompts(
            captions, text_encoders, tokenizers
        )
        examples["prompt_embeds"] = prompt_embeds_all
        examples["add_text_embeds"] = add_text_embeds_all
        return examples

    def collate_fn(examples):
        original_pixel_values = torch.stack(
            [example["original_pixel_values"] for example in examples]
        )
        original_pixel_values = original_pixel_values.to(
            memory_format=torch.contiguous_format
        ).float()
        edited_pixel_values = torch.stack([example["edited_pixel_values"] for example in examples])
        edited_pixel_values = edited_pixel_values.to(memory_format=torch.contiguous_format).float()
        prompt_embeds = torch.concat([example["prompt_embeds"] for example in examples], dim=0)
        add_text_embeds = torch.concat([example["add_text_embeds"] for example in examples], dim=0)
        return {
            "original_pixel_values": original_pixel_values,
            "edited_pixel_values": edited_pixel_values,
            "prompt_embeds": prompt_embeds,
            "add_text_embeds": add_text_embeds,
        }

    def training_step(batch):
        # We want to learn the denoising process w.r.t the edited images which
        # are conditioned on the original image (which was edited) and the edit instruction.
        # So, first, convert images to latent space.
        if args.pretrained_vae_model_name_or_path is not None:
            edited_pixel_values = batch["edited_pixel_values"].to(dtype=weight_dtype)
        else:
            edited_pixel_values = batch["edited_pixel_values"]
        latents = vae.encode(edited_pixel_values).latent_dist.sample()
        latents = latents * vae.config.scaling_factor
        if args.pretrained_vae_model_name_or_path is None:
            latents = latents.to(weight_dtype)

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()

        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        # SDXL additional inputs
        encoder_hidden_states = batch["prompt_embeds"]
        add_text_embeds = batch["add_text_embeds"]

        # Get the additional image embedding for conditioning.
        # Instead of getting a diagonal Gaussian here, we simply take the mode.
        if args.pretrained_vae_model_name_or_path is not None:
            original_pixel_values = batch["original_pixel_values"].to(dtype=weight_dtype)
        else:
            original_pixel_values = batch["original_pixel_values"]
        original_image_embeds = vae.encode(original_pixel_values).latent_dist.sample()
        if args.pretrained_vae_model_name_or_path is None:
            original_image_embeds = original_image_embeds.to(weight_dtype)

        # Conditioning dropout to support classifier-free guidance during inference. For more
        # details check out the section 3.2.1 of the original paper
        # https://huggingface.co/papers/2211.09800.
        if args.conditioning_dropout_prob is not None:
            random_p = torch.rand(bsz, device=latents.device, generator=generator)
            # Sample masks for the edit prompts.
            prompt_mask = random_p < 2 * args.conditioning_dropout_prob
            prompt_mask = prompt_mask.reshape(bsz, 1, 1)
            # Final text conditioning.
            encoder_hidden_states = torch.where(
                prompt_mask, null_conditioning, encoder_hidden_states
            )

            # Sample masks for the original images.
            image_mask_dtype = original_image_embeds.dtype
            image_mask = 1 - (
                (random_p >= args.conditioning_dropout_prob).to(image_mask_dtype)
                * (random_p < 3 * args.conditioning_dropout_prob).to(image_mask_dtype)
            )
            image_mask = image_mask.reshape(bsz, 1, 1, 1)
            # Final image conditioning.
            original_image_embeds = image_mask * original_image_embeds

        # Concatenate the `original_image_embeds` with the `noisy_latents`.
        concatenated_noisy_latents = torch.cat([noisy_latents, original_image_embeds], dim=1)

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        # Predict the noise residual and compute loss
        added_cond_kwargs = {"text_embeds": add_text_embeds, "time_ids": add_time_ids}

        model_pred = unet(
            concatenated_noisy_latents,
            timesteps,
            encoder_hidden_states,
            added_cond_kwargs=added_cond_kwargs,
            return_dict=False,
        )[0]
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        return loss

    return types.SimpleNamespace(
        step=training_step,
        unet=unet,
        generator=generator,
        preprocess_train=preprocess_train,
        collate_fn=collate_fn,
        params=[p for p in unet.parameters() if p.requires_grad],
    )


def _batch(parts, indices) -> dict:
    """``preprocess_train`` (a ``with_transform`` on the rows' batch) and ``collate_fn``."""
    originals, edits = [], []
    for index in indices:
        generator = torch.Generator().manual_seed(800 + index)
        images = torch.randint(0, 256, (2, 3, RESOLUTION, RESOLUTION), generator=generator)
        images = 2 * (images / 255) - 1
        original, edited = images
        originals.append(original)
        edits.append(edited)
    columns = parts.preprocess_train(
        {"edit_prompt": [EDITS[index % len(EDITS)] for index in indices]}
    )
    rows = [
        {
            "original_pixel_values": originals[row],
            "edited_pixel_values": edits[row],
            "prompt_embeds": columns["prompt_embeds"][row],
            "add_text_embeds": columns["add_text_embeds"][row],
        }
        for row in range(len(indices))
    ]
    return parts.collate_fn(rows)


@pytest.mark.parametrize("train_batch_size", [2, 3])
def test_pix2pix_sdxl_verifies_and_caches_both_vae_encodings(train_batch_size):
    parts = build(train_batch_size=train_batch_size)
    example = _batch(parts, range(train_batch_size))
    split = split_and_verify(parts.step, (example,))
    assert_stage1_holds_no_trainable(split)
    other = _batch(parts, range(train_batch_size, 2 * train_batch_size))
    checks = graphsplit.verify(parts.step, split, (other,), seed=1)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert stage2_top_modules(split) == {"unet"}
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == trainable_names("unet", parts.unet)
    # the raw images do not reach stage 2: the VAE's work on both of them is cached
    assert not {"original_pixel_values", "edited_pixel_values"} & set(split.boundary)


def test_pix2pix_sdxl_trains_from_its_cache_as_the_script_does(tmp_path):
    """Two identical builds, one split: step after step both consume the script's generator
    alike and give the same losses and gradients, the split one from a cache on disk."""
    # --seed=0: the generator's second draw (0.0885, 0.1320) drops the first row's prompt and
    # original image and the second row's original image, so the masks are exercised.
    plain, parts = build(seed=0), build(seed=0)
    batches = [_batch(parts, [i, i + 1]) for i in (0, 2, 4)]
    split = graphsplit.split(parts.step, (batches[0],))
    graphsplit.cache(split, batches, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert len(cached) == 6
    # split() and cache() leave the script's generator where they found it
    assert torch.equal(plain.generator.get_state(), parts.generator.get_state())
    for seed, raw in enumerate(batches):
        rows = graphsplit.collate([cached[2 * seed], cached[2 * seed + 1]])
        expected = loss_and_grads(lambda raw=raw: plain.step(raw), plain.params, seed)
        got = loss_and_grads(lambda rows=rows: split.stage2(**rows), parts.params, seed)
        assert torch.equal(got[0], expected[0]), (got[0], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    assert torch.equal(plain.generator.get_state(), parts.generator.get_state())
