"""Constant frozen work is computed once, in stage 1, even where it reads a stage-2 device.

InstructPix2Pix's script computes ``null_conditioning = text_encoder(tokenize_captions([""])
.to(device))[0]`` from no batch input: a per-dataset constant. With the device read off a
value drawn in the step (``latents.device``), taint alone would keep the text encoder in stage
2, held and re-run every step, although ``recompute="never"`` keeps all frozen work in stage 1.
Stage 1 reads the device off its own input instead and returns the constant once (no batch
dim: ``constants.safetensors`` stores it once); stage 2 neither holds nor runs the encoder.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import graphsplit
from tests.helpers import batch, frozen, split_and_verify


class ConstantThroughADrawnDevice(nn.Module):
    """A frozen layer applied to a constant moved to the device of a random draw."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        noise = torch.randn_like(x)
        null = self.encoder(torch.ones(1, 4).to(noise.device))
        keep = torch.rand(x.shape[0], 1, device=noise.device) < 0.5
        return self.head(torch.where(keep, x + noise, null)).square().mean()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_constant_frozen_call_on_a_drawn_device_runs_in_stage_1(size):
    split = split_and_verify(ConstantThroughADrawnDevice(), (batch(size, 4),))
    assert not hasattr(split.stage2, "encoder")
    assert any(spec.batch_dim is None for spec in split.boundary.values())


class DeviceOfTrainableOutput(nn.Module):
    """Frozen work whose input is trainable output stays in stage 2: only the device is not data."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.encoder = frozen(nn.Linear(4, 4))

    def forward(self, x):
        hidden = self.head(x)
        return self.encoder(hidden + torch.ones(1, 4).to(hidden.device)).square().mean()


def test_frozen_work_on_trainable_values_still_runs_in_stage_2():
    split = split_and_verify(DeviceOfTrainableOutput(), (batch(2, 4),))
    assert hasattr(split.stage2, "encoder")


pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")
from tests.zoo import build_sd_lora_step, tokenize  # noqa: E402


class InstructPix2PixStep(nn.Module):
    """The loop body of diffusers' ``train_instruct_pix2pix.py`` (conditioning dropout)."""

    def __init__(self, conditioning_dropout_prob: float = 0.3) -> None:
        super().__init__()
        parts = build_sd_lora_step()
        self.vae, self.text_encoder, self.unet = parts.vae, parts.text_encoder, parts.unet
        self.noise_scheduler = parts.scheduler
        self.conditioning_dropout_prob = conditioning_dropout_prob

    def forward(self, pixel_values, input_ids):
        latents = self.vae.encode(pixel_values).latent_dist.sample()
        latents = latents * self.vae.config.scaling_factor
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = self.text_encoder(input_ids)[0]
        random_p = torch.rand(bsz, device=latents.device)
        prompt_mask = random_p < 2 * self.conditioning_dropout_prob
        prompt_mask = prompt_mask.reshape(bsz, 1, 1)
        null_conditioning = self.text_encoder(tokenize("")[None].to(latents.device))[0]
        encoder_hidden_states = torch.where(prompt_mask, null_conditioning, encoder_hidden_states)
        model_pred = self.unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[
            0
        ]
        return F.mse_loss(model_pred.float(), noise.float())


def _batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    captions = torch.stack([tokenize(f"make it red {seed} {i}") for i in range(size)])
    return {"pixel_values": batch(size, 3, 32, 32, seed=seed), "input_ids": captions}


@pytest.mark.parametrize("size", [1, 2, 3])
def test_instruct_pix2pix_null_conditioning_is_cached_once(size, tmp_path):
    torch.manual_seed(0)
    step = InstructPix2PixStep()
    split = split_and_verify(step, tuple(_batch(size).values()))
    assert not hasattr(split.stage2, "text_encoder")
    assert not hasattr(split.stage2, "vae")
    constants = [spec for spec in split.boundary.values() if spec.batch_dim is None]
    assert [spec.shape for spec in constants] == [(1, 16, 32)]

    batches = [_batch(size, seed=seed) for seed in (1, 2)]
    graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    assert (tmp_path / "cache" / "constants.safetensors").exists()
    cached = DataLoader(
        graphsplit.CachedDataset(tmp_path / "cache", split),
        batch_size=size,
        collate_fn=graphsplit.collate,
    )
    for seed, (raw, from_cache) in enumerate(zip(batches, cached, strict=True)):
        torch.manual_seed(seed)
        expected = step(**raw)
        torch.manual_seed(seed)
        assert torch.equal(split.stage2(**from_cache), expected)
