"""Chunk loops: ``for i in range(0, x.shape[0], chunk)`` is guarded by its iteration count.

diffusers' LCM distillation scripts encode the batch in chunks of ``vae_encode_batch_size``
and ``torch.cat`` the latents. With a chunk at least as large as both probe batch sizes the
loop runs once at each, so the plan holds one iteration whose slice ``pixel_values[0:chunk]``
takes the whole batch: exact at every batch size up to the chunk. A batch that needs another
number of chunks stops with "split again for this size", naming the loop's line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.errors import SplitError, TraceError
from tests.helpers import batch, frozen, line_of, split_and_verify

CHUNK = 8  # at least both probe batch sizes (3 and 5 for an example batch of 3)


class ChunkedEncoder(nn.Module):
    """A frozen encoder run chunk by chunk, as LCM's scripts run the VAE."""

    def __init__(self, chunk: int = CHUNK, step: int | None = None) -> None:
        super().__init__()
        self.encoder = frozen(nn.Conv2d(3, 4, 2, stride=2))
        self.head = nn.Conv2d(4, 4, 1)
        self.chunk = chunk
        self.step = chunk if step is None else step

    def forward(self, pixel_values):
        latents = []
        for i in range(0, pixel_values.shape[0], self.step):
            latents.append(self.encoder(pixel_values[i : i + self.chunk]))
        latents = torch.cat(latents)
        return self.head(latents).square().mean()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_chunk_loop_that_runs_once_splits_exactly(size):
    model = ChunkedEncoder()
    split = split_and_verify(model, (batch(size, 3, 8, 8),))
    assert not hasattr(split.stage2, "encoder")
    assert "len(range(0, pixel_values.shape[0], 8))" in split.stage1.code


def test_a_batch_larger_than_the_chunk_stops_at_the_loop():
    model = ChunkedEncoder()
    split = graphsplit.split(model, (batch(2, 3, 8, 8),), max_plans=1)
    for size in (1, 7, CHUNK):
        other = batch(size, 3, 8, 8, seed=size)
        assert torch.equal(split.stage2(**split.stage1(other)), model(other))
    with pytest.raises(SplitError, match="max_plans=1") as caught:
        split.stage1(batch(CHUNK + 1, 3, 8, 8))
    message = str(caught.value)
    assert "len(range(0, pixel_values.shape[0], 8)) = 1, got 2" in message
    assert line_of(ChunkedEncoder.forward, "for i in range(") in message


def test_a_loop_whose_count_follows_the_batch_is_still_refused():
    with pytest.raises(TraceError, match="depends on the batch size") as caught:
        graphsplit.split(ChunkedEncoder(chunk=2, step=2), (batch(2, 3, 8, 8),), path="trace")
    assert line_of(ChunkedEncoder.forward, "for i in range(") in str(caught.value)


diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")
from tests.zoo import build_sd_lora_step, tokenize  # noqa: E402


class LCMStyleStep(nn.Module):
    """The VAE encoding of diffusers' ``train_lcm_distill_lora_sd_wds.py``, chunk by chunk."""

    def __init__(self, vae_encode_batch_size: int = CHUNK) -> None:
        super().__init__()
        parts = build_sd_lora_step()
        self.vae, self.text_encoder, self.unet = parts.vae, parts.text_encoder, parts.unet
        self.noise_scheduler = parts.scheduler
        self.vae_encode_batch_size = vae_encode_batch_size

    def forward(self, pixel_values, input_ids):
        vae_encode_batch_size = self.vae_encode_batch_size
        latents = []
        for i in range(0, pixel_values.shape[0], vae_encode_batch_size):
            latents.append(
                self.vae.encode(pixel_values[i : i + vae_encode_batch_size]).latent_dist.sample()
            )
        latents = torch.cat(latents, dim=0)
        latents = latents * self.vae.config.scaling_factor
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = self.text_encoder(input_ids, return_dict=False)[0]
        model_pred = self.unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[
            0
        ]
        return F.mse_loss(model_pred.float(), noise.float())


def _inputs(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    captions = torch.stack([tokenize(f"a red circle number {i}") for i in range(size)])
    return batch(size, 3, 32, 32, seed=seed), captions


@pytest.mark.parametrize("size", [1, 2, 3])
def test_lcm_chunked_vae_encoding_splits_exactly(size):
    torch.manual_seed(0)
    step = LCMStyleStep()
    split = split_and_verify(step, _inputs(size))
    split.plan_set.max_plans = 1  # refuse another size, make no plan for it
    assert not hasattr(split.stage2, "vae")
    if size == 3:
        with pytest.raises(SplitError, match="max_plans=1") as caught:
            split.stage1(*_inputs(CHUNK + 1, seed=1))
        assert line_of(LCMStyleStep.forward, "for i in range(") in str(caught.value)
