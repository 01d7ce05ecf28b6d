"""Conformance: ``examples/text_to_image/train_text_to_image.py``'s loop body on a LoRA UNet,
every loss option on at once.

The loop body is the script's (``--noise_offset``: an extra ``torch.randn`` of shape ``(bsz,
channels, 1, 1)`` added to the noise; ``--input_perturbation``: a second draw, ``new_noise``,
that noises the latents while the target stays ``noise``; ``--prediction_type`` set with
``register_to_config`` inside the step; ``--snr_gamma 5.0``: ``compute_snr`` min-SNR loss
weights, divided by ``snr`` for epsilon and by ``snr + 1`` for v-prediction), run on the UNet of
``train_text_to_image_lora.py``: frozen, with peft LoRA on ``to_q/to_k/to_v/to_out.0`` added by
``unet.add_adapter`` (only the LoRA weights train). The frozen VAE and CLIP text encoder are in
eval mode. The batch is the script's ``collate_fn`` output (``pixel_values``, ``input_ids``).

What must hold, for epsilon and v-prediction: the step splits exactly (loss and every LoRA
gradient bit for bit, on the example and on a batch of another size), every draw (VAE sample,
noise, offset noise, perturbation, timesteps) stays in stage 2, the VAE's latent distribution
and the text embedding are cached (neither module is held by stage 2), and a cache written
through the disk trains stage 2 exactly.

Tiny configs: the zoo's ``tiny`` SD LoRA step's components (UNet (32, 64), rank 4, ``lora_B``
drawn small), 32 px.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from diffusers.training_utils import compute_snr  # noqa: E402

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules  # noqa: E402
from tests.zoo import CaptionedImages, build_sd_lora_step  # noqa: E402


def collate_fn(examples):
    """The script's, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    input_ids = torch.stack([example["input_ids"] for example in examples])
    return {"pixel_values": pixel_values, "input_ids": input_ids}


def build(prediction_type):
    parts = build_sd_lora_step()  # LoRA via unet.add_adapter; only lora_A / lora_B train
    vae, text_encoder, unet = parts.vae, parts.text_encoder, parts.unet
    noise_scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear"
    )
    args = types.SimpleNamespace(
        noise_offset=0.1,
        input_perturbation=0.1,
        prediction_type=prediction_type,
        snr_gamma=5.0,
    )
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

        # Predict the noise residual and compute loss
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]

        if args.snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            # Compute loss-weights as per Section 3.4 of https://arxiv.org/abs/2303.09556.
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

    params = [p for p in unet.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in unet.named_parameters() if p.requires_grad)
    return types.SimpleNamespace(step=training_step, unet=unet, params=params)


def _batch(size: int, first: int = 0) -> dict:
    items = CaptionedImages(length=first + size)
    return collate_fn([items[i] for i in range(first, first + size)])


PREDICTIONS = {"epsilon": None, "v-prediction": "v_prediction"}
_BUILT: dict[str, tuple] = {}


def _built(name: str):
    if name not in _BUILT:
        parts = build(PREDICTIONS[name])
        _BUILT[name] = (parts, graphsplit.split(parts.step, (_batch(2),)))
    return _BUILT[name]


@pytest.mark.parametrize("name", list(PREDICTIONS))
def test_every_option_on_splits_exactly_on_the_example_and_another_size(name):
    parts, split = _built(name)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(2), _batch(3, first=2)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("name", list(PREDICTIONS))
def test_the_vae_and_text_encoder_are_cached_and_every_draw_stays(name):
    parts, split = _built(name)
    assert split.path == "trace"
    assert stage2_top_modules(split) == {"unet"}
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {f"unet.{n}" for n, p in parts.unet.named_parameters() if p.requires_grad}
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    # the VAE's latent distribution (mean and log-variance, resampled in stage 2) and the
    # CLIP hidden states
    assert per_sample == {
        "vae_encode_latent_dist_parameters": (8, 16, 16),
        "text_encoder_0": (16, 32),
    }
    report = split.report()
    # in the step's order: the VAE sample, the noise, the offset noise, the perturbation,
    # the timesteps
    kept = report.split("Random draws kept in stage 2")[1].splitlines()[1:6]
    assert [line.split()[1] for line in kept] == [
        *("aten.randn", "aten.randn_like", "aten.randn", "aten.randn_like", "aten.randint")
    ], report


@pytest.mark.parametrize("name", list(PREDICTIONS))
def test_cache_round_trip(name, tmp_path):
    parts, split = _built(name)
    loader = DataLoader(CaptionedImages(length=5), batch_size=2, collate_fn=collate_fn)
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)
