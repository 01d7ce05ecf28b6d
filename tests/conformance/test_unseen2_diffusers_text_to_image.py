"""Conformance: ``examples/text_to_image/train_text_to_image.py``'s training step, with its flags.

Full fine-tuning of the UNet (no LoRA) beside the frozen VAE and CLIP text encoder, the loop
body copied from the script with the options it offers: ``--noise_offset`` (an extra
``torch.randn`` of shape ``(bsz, channels, 1, 1)``), ``--input_perturbation`` (a second noise
draw), ``--snr_gamma`` (``compute_snr`` loss weights, with ``epsilon`` and ``v_prediction``,
the latter set by ``register_to_config`` inside the step) and ``--dream_training``
(``compute_dream_and_update_latents``: the *trainable* UNet run once more under
``torch.no_grad()`` inside diffusers' own code).

What must hold: every variant splits exactly (losses and every UNet gradient bit for bit, on
the example and on other data); the VAE and the text encoder are cached, their weights not
held by stage 2; every draw stays in stage 2. DREAM's ``no_grad`` around the trainable UNet
cannot be traced (fx records ops, not grad modes), so ``path="auto"`` takes the module-level
path, naming diffusers' line in its reason.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from diffusers.training_utils import compute_dream_and_update_latents, compute_snr  # noqa: E402

from tests.conformance.unseen_checks import assert_cache_round_trip  # noqa: E402
from tests.zoo import CaptionedImages, build_frozen_sd  # noqa: E402


def build(**flags):
    """``main()``'s models with ``args`` from ``flags``, and the loop body as a closure."""
    vae, text_encoder, unet, noise_scheduler = build_frozen_sd()
    unet.requires_grad_(True)
    unet.train()
    args = types.SimpleNamespace(
        noise_offset=0.0,
        input_perturbation=0.0,
        prediction_type=None,
        dream_training=False,
        dream_detail_preservation=1.0,
        snr_gamma=None,
    )
    for k, v in flags.items():
        setattr(args, k, v)
    weight_dtype = torch.float32

    def training_step(batch):
        # Convert images to latent space
        latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
        latents = latents * vae.config.scaling_factor

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        if args.noise_offset:
            # https://www.crosslabs.org//blog/diffusion-with-offset-noise
            noise += args.noise_offset * torch.randn(
                (latents.shape[0], latents.shape[1], 1, 1), device=latents.device
            )
        if args.input_perturbation:
            new_noise = noise + args.input_perturbation * torch.randn_like(noise)
        bsz = latents.shape[0]
        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()

        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        if args.input_perturbation:
            noisy_latents = noise_scheduler.add_noise(latents, new_noise, timesteps)
        else:
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        # Get the text embedding for conditioning
        encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]

        # Get the target for loss depending on the prediction type
        if args.prediction_type is not None:
            # set prediction_type of scheduler if defined
            noise_scheduler.register_to_config(prediction_type=args.prediction_type)

        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        if args.dream_training:
            noisy_latents, target = compute_dream_and_update_latents(
                unet,
                noise_scheduler,
                timesteps,
                noise,
                noisy_latents,
                target,
                encoder_hidden_states,
                args.dream_detail_preservation,
            )

        # Predict the noise residual and compute loss
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]

        if args.snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            # Compute loss-weights as per Section 3.4 of
            # https://arxiv.org/abs/2303.09556.
            # Since we predict the noise instead of x_0, the original formulation is slightly
            # changed.
            # This is discussed in Section 4.2 of the same paper.
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack(
                [snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1
            ).min(dim=1)[0]
            if noise_scheduler.config.prediction_type == "epsilon":
                mse_loss_weights = mse_loss_weights / snr
            elif noise_scheduler.config.prediction_type == "v_prediction":
                mse_loss_weights = mse_loss_weights / (snr + 1)

            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()
        return loss

    return training_step, unet


def _batch(size: int, first: int = 0) -> dict:
    items = CaptionedImages(length=first + size)
    return next(iter(DataLoader([items[i] for i in range(first, first + size)], batch_size=size)))


FLAGS = {
    "plain": {},
    "noise-offset": {"noise_offset": 0.05},
    "input-perturbation": {"input_perturbation": 0.1},
    "snr-gamma": {"snr_gamma": 5.0},
    "v-prediction-snr-gamma": {"prediction_type": "v_prediction", "snr_gamma": 5.0},
}


@pytest.mark.parametrize("flags", list(FLAGS.values()), ids=list(FLAGS))
def test_each_option_splits_exactly_with_the_vae_and_text_encoder_cached(flags):
    step, _ = build(**flags)
    split = split_and_verify(step, (_batch(2),))
    assert split.path == "trace"
    assert sorted(split.boundary) == ["text_encoder_0", "vae_encode_latent_dist_parameters"]
    held = {name.split(".")[0] for name, _ in split.stage2.named_parameters()}
    assert held == {"unet"}
    assert all(c.ok for c in graphsplit.verify(step, split, (_batch(3, first=2),), seed=3))


def test_dream_training_takes_the_module_level_path_naming_diffusers_no_grad_line():
    step, _ = build(dream_training=True)
    split = split_and_verify(step, (_batch(2),))
    assert split.path == "calls"
    assert "The step disables gradients" in split.reason
    assert "diffusers/training_utils.py" in split.reason
    assert "pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample" in split.reason
    verdicts = {(v.path, v.index): v.verdict.value for v in split.plan.verdicts}
    assert verdicts[("text_encoder", 0)] == "cached" and verdicts[("vae.quant_conv", 0)] == "cached"
    assert all(c.ok for c in graphsplit.verify(step, split, (_batch(3, first=2),), seed=3))


@pytest.mark.parametrize(
    "flags", [FLAGS["snr-gamma"], {"dream_training": True}], ids=["snr", "dream"]
)
def test_a_cache_of_the_loader_trains_as_the_step(flags, tmp_path):
    step, unet = build(**flags)
    split = graphsplit.split(step, (_batch(2),))
    loader = DataLoader(CaptionedImages(length=6), batch_size=2)
    assert_cache_round_trip(split, step, loader, tmp_path, unet, rows_per_batch=2)
