"""A diffusers training script's loop body, moved into a function, splits as written.

The body of ``training_step`` is the loop of diffusers' ``examples/text_to_image/
train_text_to_image_lora.py`` with no change but its indentation: the models and the scheduler
are module globals (the script's locals), the batch is the ``DataLoader``'s dict, the options
are an ``args`` namespace. The models are tiny (tests/zoo), the UNet has peft LoRA adapters
added with diffusers' own ``unet.add_adapter`` as the script does.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_snr
from torch.utils.data import DataLoader

import graphsplit
from tests.zoo import CaptionedImages, build_sd_lora_step

# The script's globals (set by _script_globals, as the script sets its locals).
vae = text_encoder = unet = noise_scheduler = None
weight_dtype = torch.float32
args = types.SimpleNamespace(noise_offset=0, prediction_type=None, snr_gamma=None)


def training_step(batch):
    # Convert images to latent space
    latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
    latents = latents * vae.config.scaling_factor

    # Sample noise that we'll add to the latents
    noise = torch.randn_like(latents)
    if args.noise_offset:
        # https://www.crosslabs.org//blog/diffusion-with-offset-noise
        noise += args.noise_offset * torch.randn(
            (latents.shape[0], latents.shape[1], 1, 1), device=latents.device
        )

    bsz = latents.shape[0]
    # Sample a random timestep for each image
    timesteps = torch.randint(
        0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
    )
    timesteps = timesteps.long()

    # Add noise to the latents according to the noise magnitude at each timestep
    # (this is the forward diffusion process)
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
        # Since we predict the noise instead of x_0, the original formulation is slightly changed.
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


@pytest.fixture
def _script_globals(monkeypatch):
    parts = build_sd_lora_step(seed=0)
    for name, value in {
        "vae": parts.vae,
        "text_encoder": parts.text_encoder,
        "unet": parts.unet,
        "noise_scheduler": parts.scheduler,
    }.items():
        monkeypatch.setitem(globals(), name, value)
    for option in ("noise_offset", "prediction_type", "snr_gamma"):
        monkeypatch.setattr(args, option, getattr(args, option))  # restored after the test
    return parts


def _batches(count: int, batch_size: int = 2) -> list[dict]:
    loader = DataLoader(CaptionedImages(length=count * batch_size), batch_size=batch_size)
    return list(loader)


@pytest.mark.usefixtures("_script_globals")
@pytest.mark.parametrize(
    ("noise_offset", "prediction_type", "snr_gamma"),
    [(0, None, None), pytest.param(0.1, "v_prediction", 5.0, marks=pytest.mark.slow)],
    ids=["defaults", "offset-noise-v-prediction-min-snr"],
)
def test_the_loop_body_splits_bit_for_bit(noise_offset, prediction_type, snr_gamma):
    args.noise_offset, args.prediction_type, args.snr_gamma = (
        noise_offset,
        prediction_type,
        snr_gamma,
    )
    batch = _batches(1)[0]
    split = graphsplit.split(training_step, (batch,))

    assert list(split.boundary) == ["vae_encode_latent_dist_parameters", "text_encoder_0"]
    assert split.stage2.unet is unet and not hasattr(split.stage2, "vae")
    assert all(key.startswith("unet.") for key in split.stage2.state_dict())
    assert "noise_scheduler_alphas_cumprod" in split.stage2.code
    assert split.input_names == ("key", "pixel_values", "input_ids")  # the DataLoader's fields

    comparisons = graphsplit.verify(training_step, split, (batch,))
    assert len(comparisons) == 1 + sum(p.requires_grad for p in unet.parameters())
    torch.manual_seed(3)
    expected = training_step(batch)
    torch.manual_seed(3)
    assert torch.equal(split.stage2(**split.stage1(**batch)), expected)


@pytest.mark.slow
@pytest.mark.usefixtures("_script_globals")
def test_the_scripts_optimizer_trains_stage2_from_the_cache_as_the_loop_trains(tmp_path):
    batches = _batches(2)
    split = graphsplit.split(training_step, (batches[0],))
    graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    cached = DataLoader(
        graphsplit.CachedDataset(tmp_path / "cache", split),
        batch_size=2,
        collate_fn=graphsplit.collate,
    )
    initial = {name: p.detach().clone() for name, p in unet.named_parameters() if p.requires_grad}

    def train(steps) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for name, param in unet.named_parameters():
                if name in initial:
                    param.copy_(initial[name])
        lora_layers = filter(lambda p: p.requires_grad, unet.parameters())  # as the script
        optimizer = torch.optim.AdamW(lora_layers, lr=1e-3)
        for seed, step in enumerate(steps):
            torch.manual_seed(seed)
            step().backward()
            optimizer.step()
            optimizer.zero_grad()
        return {name: p.detach().clone() for name, p in unet.named_parameters() if name in initial}

    full = train([lambda b=b: training_step(b) for b in batches])
    from_cache = train([lambda b=b: split.stage2(**b) for b in cached])
    assert full.keys() == from_cache.keys()
    changed = [name for name in full if not torch.equal(full[name], initial[name])]
    assert changed, "training did not move any LoRA weight"
    for name in full:
        assert torch.equal(full[name], from_cache[name]), name
