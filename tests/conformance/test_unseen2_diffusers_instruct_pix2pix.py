"""Conformance: ``examples/instruct_pix2pix/train_instruct_pix2pix.py``'s training step.

The whole UNet trains (full fine-tuning, no LoRA), its ``conv_in`` widened to 8 channels as the
script widens it (the extra input channels zero-initialised). The step encodes the *edited*
image with the frozen VAE and samples its latent (``latent_dist.sample()``: a random draw after
the frozen work), encodes the *original* image with ``latent_dist.mode()`` and the edit
instruction with the frozen CLIP text encoder, then applies the script's conditioning dropout:
one ``torch.rand(bsz, generator=generator)`` draw from a ``torch.Generator`` made in ``main()``
(not the global RNG), a null prompt encoded in the step by the real tokenizer
(``tokenize_captions([""])``), ``torch.where`` between the two text conditionings and a mask on
the original image's latent. The loop body is copied from the script as a closure over
``main()``'s locals, the batch from its ``preprocess_train`` + ``collate_fn``.

What must hold: the VAE's moments of both images, the text encoder's output and the null
prompt's embedding are cached (stage 2 holds no VAE or text-encoder weight); the draws (the
latent sample, noise, timesteps and the script's own generator) stay in stage 2 in the step's
order, so a split run draws what the unsplit run draws, bit for bit.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch import nn

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen_checks import (  # noqa: E402
    loss_and_grads,
    stage2_top_modules,
    word_tokenizer,
)
from tests.zoo import build_frozen_sd  # noqa: E402

WORDS = [
    "make",
    "it",
    "a",
    "snowy",
    "winter",
    "scene",
    "turn",
    "the",
    "sky",
    "red",
    "add",
    "fireworks",
]
EDITS = ["make it a snowy winter scene", "turn the sky red", "add fireworks", "make it red"]
RESOLUTION = 32


def build(conditioning_dropout_prob: float | None = 0.05, seed: int = 42):
    """``main()``'s models and the loop body as a closure over them, as the script builds them."""
    set_seed(seed)  # the script's ``if args.seed is not None: set_seed(args.seed)``
    vae, text_encoder, unet, _ = build_frozen_sd()
    tokenizer = word_tokenizer(WORDS)
    tokenizer.model_max_length = 16
    noise_scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)
    # InstructPix2Pix uses an additional image for conditioning: 8 input channels, the extra
    # ones zero-initialised (the script's lines, verbatim but for the logger).
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

    # Freeze vae and text_encoder
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.requires_grad_(True)
    unet.train()

    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    args = types.SimpleNamespace(conditioning_dropout_prob=conditioning_dropout_prob, seed=seed)
    weight_dtype = torch.float32
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed)

    def tokenize_captions(captions):
        inputs = tokenizer(
            captions,
            max_length=tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )
        return inputs.input_ids

    def training_step(batch):
        # We want to learn the denoising process w.r.t the edited images which
        # are conditioned on the original image (which was edited) and the edit instruction.
        # So, first, convert images to latent space.
        latents = vae.encode(batch["edited_pixel_values"].to(weight_dtype)).latent_dist.sample()
        latents = latents * vae.config.scaling_factor

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

        # Get the text embedding for conditioning.
        encoder_hidden_states = text_encoder(batch["input_ids"])[0]

        # Get the additional image embedding for conditioning.
        # Instead of getting a diagonal Gaussian here, we simply take the mode.
        original_image_embeds = vae.encode(
            batch["original_pixel_values"].to(weight_dtype)
        ).latent_dist.mode()

        # Conditioning dropout to support classifier-free guidance during inference. For more
        # details check out the section 3.2.1 of the original paper
        # https://arxiv.org/abs/2211.09800.
        if args.conditioning_dropout_prob is not None:
            random_p = torch.rand(bsz, device=latents.device, generator=generator)
            # Sample masks for the edit prompts.
            prompt_mask = random_p < 2 * args.conditioning_dropout_prob
            prompt_mask = prompt_mask.reshape(bsz, 1, 1)
            # Final text conditioning.
            null_conditioning = text_encoder(tokenize_captions([""]).to(accelerator.device))[0]
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
        model_pred = unet(concatenated_noisy_latents, timesteps, encoder_hidden_states).sample
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        return loss

    return types.SimpleNamespace(
        step=training_step,
        unet=unet,
        generator=generator,
        tokenize_captions=tokenize_captions,
    )


def _examples(indices, tokenize_captions) -> list[dict]:
    """``preprocess_train``'s rows: original and edited images in [-1, 1], the edit's ids."""
    rows = []
    for index in indices:
        generator = torch.Generator().manual_seed(700 + index)
        images = torch.randint(0, 256, (2, 3, RESOLUTION, RESOLUTION), generator=generator)
        images = 2 * (images / 255) - 1
        original, edited = images.chunk(2)
        rows.append(
            {
                "original_pixel_values": original.reshape(3, RESOLUTION, RESOLUTION),
                "edited_pixel_values": edited.reshape(3, RESOLUTION, RESOLUTION),
                "input_ids": tokenize_captions([EDITS[index % len(EDITS)]])[0],
            }
        )
    return rows


def collate_fn(examples):
    """The script's ``collate_fn``, verbatim."""
    original_pixel_values = torch.stack([example["original_pixel_values"] for example in examples])
    original_pixel_values = original_pixel_values.to(memory_format=torch.contiguous_format).float()
    edited_pixel_values = torch.stack([example["edited_pixel_values"] for example in examples])
    edited_pixel_values = edited_pixel_values.to(memory_format=torch.contiguous_format).float()
    input_ids = torch.stack([example["input_ids"] for example in examples])
    return {
        "original_pixel_values": original_pixel_values,
        "edited_pixel_values": edited_pixel_values,
        "input_ids": input_ids,
    }


def _batch(parts, indices) -> dict:
    return collate_fn(_examples(indices, parts.tokenize_captions))


@pytest.mark.parametrize("size", [1, 3])
def test_the_vae_and_text_encoder_are_cached_and_the_generators_draw_stays_in_stage2(size):
    parts = build()
    split = split_and_verify(parts.step, (_batch(parts, range(size)),))
    assert stage2_top_modules(split) >= {"unet"}
    assert not stage2_top_modules(split) & {"vae", "text_encoder"}
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {f"unet.{n}" for n, _ in parts.unet.named_parameters()}
    other = _batch(parts, range(size, 2 * size))
    assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=1))


def test_the_scripts_generator_advances_as_in_the_unsplit_run(tmp_path):
    """Two identical builds, one split: step after step both runs consume the script's
    generator alike and log the same losses and gradients, from a cache on disk."""
    plain, parts = build(), build()
    batches = [_batch(parts, [i, i + 1]) for i in (0, 2, 4)]
    split = graphsplit.split(parts.step, (batches[0],))
    graphsplit.cache(split, batches, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    plain_params = [p for p in plain.unet.parameters() if p.requires_grad]
    split_params = [p for p in parts.unet.parameters() if p.requires_grad]
    # split() must leave the script's generator where it found it
    assert torch.equal(plain.generator.get_state(), parts.generator.get_state())
    for seed, raw in enumerate(batches):
        rows = graphsplit.collate([cached[2 * seed], cached[2 * seed + 1]])
        expected = loss_and_grads(lambda raw=raw: plain.step(raw), plain_params, seed)
        got = loss_and_grads(lambda rows=rows: split.stage2(**rows), split_params, seed)
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    assert torch.equal(plain.generator.get_state(), parts.generator.get_state())


def test_without_conditioning_dropout_the_same_is_cached():
    parts = build(conditioning_dropout_prob=None)
    split = split_and_verify(parts.step, (_batch(parts, [0, 1]),))
    assert not stage2_top_modules(split) & {"vae", "text_encoder"}
