"""Conformance: an SD3-style flow-matching step, timesteps sampled as diffusers' script does.

``compute_density_for_timestep_sampling`` draws with an explicit ``device="cpu"`` and no traced
input; the script then indexes the scheduler's (real) ``timesteps`` and ``sigmas`` with the
drawn indices. All of it must be drawn in stage 2, every step; the frozen VAE is cached.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)


class TinyTransformer(nn.Module):
    """Stands in for the trainable SD3 transformer: conditions on the timestep."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.time = nn.Linear(1, channels)

    def forward(self, hidden_states, timestep):
        scale = self.time(timestep[:, None] / 1000.0)[:, :, None, None]
        return self.conv(hidden_states) * (1 + scale)


class SD3FlowMatchingStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vae = diffusers.AutoencoderKL(
            block_out_channels=(8,),
            norm_num_groups=4,
            latent_channels=4,
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
        ).requires_grad_(False)
        self.transformer = TinyTransformer(4)
        self.noise_scheduler_copy = diffusers.FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0
        )

    def get_sigmas(self, indices, n_dim, dtype):
        sigma = self.noise_scheduler_copy.sigmas.to(dtype=dtype)[indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def forward(self, pixel_values):
        model_input = self.vae.encode(pixel_values).latent_dist.sample()
        model_input = (model_input - 0.0609) * 1.5305
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme="logit_normal",
            batch_size=bsz,
            logit_mean=0.0,
            logit_std=1.0,
            mode_scale=1.29,
        )
        indices = (u * self.noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = self.noise_scheduler_copy.timesteps[indices].to(device=model_input.device)
        sigmas = self.get_sigmas(indices, n_dim=model_input.ndim, dtype=model_input.dtype)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        model_pred = self.transformer(noisy_model_input, timesteps)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="logit_normal", sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(bsz, -1), 1
        )
        return loss.mean()


@pytest.mark.parametrize("size", [2, 3])
def test_sd3_timestep_density_sampling_is_drawn_in_stage_2(size):
    torch.manual_seed(0)
    model = SD3FlowMatchingStep()
    pixels = torch.randn(size, 3, 16, 16)
    before = torch.get_rng_state()
    split = split_and_verify(model, (pixels,))
    stage2_modules = {name.split(".")[0] for name, _ in split.stage2.named_modules() if name}
    assert stage2_modules == {"transformer"}
    assert "torch.normal(" in split.stage2.code and "device = 'cpu'" in split.stage2.code
    assert "self.vae" not in split.stage2.code
    # The analysis itself never drew: a second split leaves the generator where it was.
    torch.set_rng_state(before)
    graphsplit.split(model, (pixels,))
    assert torch.equal(torch.get_rng_state(), before)
