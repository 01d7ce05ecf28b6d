"""Frozen work that reads no batch input is computed once: InstructPix2Pix's null conditioning.

diffusers' ``train_instruct_pix2pix.py`` drops the edit prompt for some samples by swapping in
the encoding of the empty prompt, ``text_encoder(tokenize_captions([""]).to(device))[0]``.
That value is the same for the whole dataset: the plan caches it once (``constants.safetensors``)
and stage 2 neither holds nor runs the text encoder. The script moves the tokens to
``accelerator.device``; a step written as an ``nn.Module`` reads the device off the latents,
which come from a random draw (``latent_dist.sample()``): that read must not make the text
encoder per step (:mod:`graphsplit.planning.rules.metadata_reads`). A "constant" that depends on
a random draw is not one: it stays in stage 2.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from torch import nn
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.errors import StaleCacheError
from tests.helpers import frozen, param_names, split_and_verify
from tests.zoo.data import tokenize
from tests.zoo.sd import _build_scheduler, _build_text_encoder, _build_vae, _seeded, _size

CONDITIONING_DROPOUT_PROB = 0.3  # upstream's default is 0.05: larger, so tiny batches drop some


def tokenize_captions(captions: list[str]) -> torch.Tensor:
    """The script's ``tokenize_captions`` (padding to the max length), with the zoo's tokenizer."""
    return torch.stack([tokenize(caption) for caption in captions])


class InstructPix2PixStep(nn.Module):
    """The training step of diffusers' ``train_instruct_pix2pix.py``, as a module.

    ``forward(edited_pixel_values, original_pixel_values, input_ids)`` returns the loss. The
    UNet takes 8 input channels: the noisy latents concatenated with the original image's.
    """

    def __init__(self, vae, text_encoder, unet, noise_scheduler, *, null_from_noise=False):
        super().__init__()
        self.vae = vae
        self.text_encoder = text_encoder
        self.unet = unet
        self.noise_scheduler = noise_scheduler
        self.null_from_noise = null_from_noise

    def forward(self, edited_pixel_values, original_pixel_values, input_ids):
        # We want to learn the denoising process w.r.t the edited images which
        # are conditioned on the original image (which was edited) and the edit instruction.
        latents = self.vae.encode(edited_pixel_values).latent_dist.sample()
        latents = latents * self.vae.config.scaling_factor
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = self.text_encoder(input_ids)[0]
        original_image_embeds = self.vae.encode(original_pixel_values).latent_dist.mode()
        # Conditioning dropout to support classifier-free guidance during inference.
        random_p = torch.rand(bsz, device=latents.device)
        prompt_mask = random_p < 2 * CONDITIONING_DROPOUT_PROB
        prompt_mask = prompt_mask.reshape(bsz, 1, 1)
        if self.null_from_noise:  # not a constant: the tokens are drawn every step
            null_ids = torch.randint(0, 990, (1, 16), device=latents.device)
        else:
            null_ids = tokenize_captions([""]).to(latents.device)
        null_conditioning = self.text_encoder(null_ids)[0]  # the null conditioning
        encoder_hidden_states = torch.where(prompt_mask, null_conditioning, encoder_hidden_states)
        image_mask_dtype = original_image_embeds.dtype
        image_mask = 1 - (
            (random_p >= CONDITIONING_DROPOUT_PROB).to(image_mask_dtype)
            * (random_p < 3 * CONDITIONING_DROPOUT_PROB).to(image_mask_dtype)
        )
        image_mask = image_mask.reshape(bsz, 1, 1, 1)
        original_image_embeds = image_mask * original_image_embeds
        concatenated_noisy_latents = torch.cat([noisy_latents, original_image_embeds], dim=1)
        model_pred = self.unet(
            concatenated_noisy_latents, timesteps, encoder_hidden_states, return_dict=False
        )[0]
        return F.mse_loss(model_pred.float(), noise.float(), reduction="mean")


def build_step(*, null_from_noise: bool = False) -> InstructPix2PixStep:
    spec = _size("tiny")
    vae = _build_vae(spec, 0, on_meta=False)
    text_encoder = _build_text_encoder(spec.text, 0, on_meta=False)
    with _seeded(5):
        unet = UNet2DConditionModel(**{**spec.unet, "in_channels": 8}).train()
    return InstructPix2PixStep(
        vae, text_encoder, unet, _build_scheduler(), null_from_noise=null_from_noise
    )


def pix2pix_batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    captions = ["make it blue", "turn the circle red", "add stripes", "paint it white"]
    return {
        "edited_pixel_values": torch.randn(size, 3, 32, 32, generator=generator),
        "original_pixel_values": torch.randn(size, 3, 32, 32, generator=generator),
        "input_ids": tokenize_captions([captions[(seed + i) % 4] for i in range(size)]),
    }


@pytest.fixture(scope="module")
def pix2pix():
    step = build_step()
    split = graphsplit.split(step, kwargs=pix2pix_batch(2))
    return step, split


def null_conditioning_spec(split: graphsplit.Split) -> graphsplit.BoundarySpec:
    (spec,) = (spec for spec in split.boundary.values() if spec.is_constant)
    return spec


def test_the_null_conditioning_is_a_constant_of_the_boundary(pix2pix):
    _, split = pix2pix
    spec = null_conditioning_spec(split)
    assert (spec.shape, spec.dtype, spec.batch_dim, spec.bytes_per_sample) == (
        (1, 16, 32),
        torch.float32,
        None,
        0,
    )
    assert spec.source.endswith(f"test_constant_frozen.py:{_line('# the null conditioning')}")
    # named after the user's variable: in stage 2's code, the cache and the report
    assert spec.name == "null_conditioning"
    assert "def forward(self, " in split.stage2.code
    signature = split.stage2.code.split("def forward(self, ", 1)[1].split(")", 1)[0]
    assert "null_conditioning" in signature.split(", ")


def _line(text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(InstructPix2PixStep.forward)
    (offset,) = (i for i, line in enumerate(lines) if text in line)
    return start + offset


def test_stage2_neither_holds_nor_calls_the_text_encoder(pix2pix):
    step, split = pix2pix
    held = param_names(split.stage2, step)
    assert held and all(name.startswith("unet.") for name in held)
    assert not any("text_encoder" in str(node.target) for node in split.cut.stage2)
    assert "self.text_encoder" not in split.stage2.code
    # the device read off the random latents still feeds stage 2's own draws
    assert "torch.rand(" in split.stage2.code and "torch.randint(" in split.stage2.code


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_losses_and_gradients_are_bit_equal_to_the_unsplit_step(pix2pix, batch_size):
    step, split = pix2pix
    comparisons = graphsplit.verify(step, split, kwargs=pix2pix_batch(batch_size), seed=0)
    assert comparisons and all(c.ok for c in comparisons)
    assert any("unet." in c.name for c in comparisons)  # the gradients are compared too


def test_the_null_conditioning_is_dropped_in_for_some_samples_in_the_check(pix2pix):
    """The check above would be weak if no sample took the null conditioning: seed 0 drops."""
    step, split = pix2pix
    batch = pix2pix_batch(3)
    torch.manual_seed(0)
    cached = split.stage1(**batch)
    torch.manual_seed(0)
    step.vae.encode(batch["edited_pixel_values"]).latent_dist.sample()
    torch.randn(3, 4, 16, 16), torch.randint(0, 1000, (3,))
    dropped = torch.rand(3) < 2 * CONDITIONING_DROPOUT_PROB
    assert 0 < int(dropped.sum()) < 3
    spec = null_conditioning_spec(split)
    expected = step.text_encoder(tokenize_captions([""]))[0]
    assert torch.equal(cached[spec.name], expected)


def test_cache_round_trip_is_exact_and_stores_the_constant_once(pix2pix, tmp_path):
    step, split = pix2pix
    batches = [pix2pix_batch(3, seed=seed) for seed in (1, 2)]
    graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    spec = null_conditioning_spec(split)
    constants = safetensors.torch.load_file(tmp_path / "cache" / "constants.safetensors")
    assert list(constants) == [spec.name] and constants[spec.name].shape == (1, 16, 32)
    shards = sorted((tmp_path / "cache").glob("shard-*.safetensors"))
    assert shards
    for shard in shards:  # not one row per sample
        assert not any(spec.name in key for key in safetensors.torch.load_file(shard))
    dataset = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert list(dataset.constants) == [spec.name]
    cached = DataLoader(dataset, batch_size=3, collate_fn=graphsplit.collate)
    for seed, (raw, cached_batch) in enumerate(zip(batches, cached, strict=True)):
        assert cached_batch[spec.name].shape == (1, 16, 32)
        step.zero_grad()
        torch.manual_seed(seed)
        expected = step(**raw)
        expected.backward()
        expected_grads = {n: p.grad.clone() for n, p in step.named_parameters() if p.requires_grad}
        step.zero_grad()
        torch.manual_seed(seed)
        loss = split.stage2(**cached_batch)
        loss.backward()
        assert torch.equal(loss, expected)
        for name, parameter in step.named_parameters():
            if parameter.requires_grad:
                assert torch.equal(parameter.grad, expected_grads[name]), name


def test_a_cache_made_before_the_text_encoder_changed_is_refused(tmp_path):
    step = build_step()
    split = graphsplit.split(step, kwargs=pix2pix_batch(2))
    graphsplit.cache(split, [pix2pix_batch(2)], tmp_path / "cache", progress=False)
    norm = step.text_encoder.final_layer_norm
    norm.weight.data = norm.weight.data + 1  # new storage: the constant would change
    with pytest.raises(StaleCacheError, match="weights"):
        graphsplit.CachedDataset(tmp_path / "cache", split)


def test_null_conditioning_drawn_from_random_tokens_is_not_a_constant():
    step = build_step(null_from_noise=True)
    split = split_and_verify(step, (), pix2pix_batch(2))
    assert not any(spec.is_constant for spec in split.boundary.values())
    held = param_names(split.stage2, step)
    assert any(name.startswith("text_encoder.") for name in held)  # it runs every step
    for batch_size in (1, 3):
        comparisons = graphsplit.verify(step, split, kwargs=pix2pix_batch(batch_size), seed=0)
        assert comparisons and all(c.ok for c in comparisons)


# -- small synthetic steps -------------------------------------------------------------------
class NullEmbedding(nn.Module):
    """A frozen encoder applied to a fixed buffer, moved to the noise's device and dtype."""

    def __init__(self, source: str = "buffer") -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(8, 6))
        self.head = nn.Linear(6, 6)
        self.register_buffer("null_input", torch.linspace(-1, 1, 8).reshape(1, 8))
        self.source = source

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(x) + torch.randn_like(x[:, :6])
        if self.source == "buffer":  # a constant: frozen weights and a buffer
            null = self.null_input.to(hidden.device, hidden.dtype)
        elif self.source == "drawn":  # not a constant: a random draw
            null = torch.randn(1, 8, device=hidden.device)
        else:  # a device read that cannot be traced back to a stage-1 tensor
            null = self.null_input.to(torch.randn(1, 1, device="cpu").device)
        null = self.encoder(null)
        keep = (torch.rand(x.shape[0], 1) > 0.5).to(hidden.dtype)
        mixed = keep * hidden + (1 - keep) * null
        return F.mse_loss(self.head(mixed), target)


def small_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 6, generator=generator)


def test_a_frozen_encoding_of_a_buffer_is_cached_once():
    step = NullEmbedding("buffer")
    split = split_and_verify(step, small_batch(2))
    constants = [spec for spec in split.boundary.values() if spec.is_constant]
    assert [(spec.name, spec.shape, spec.bytes_per_sample) for spec in constants] == [
        ("null", (1, 6), 0)
    ]
    assert param_names(split.stage2, step) == {"head.weight", "head.bias"}
    for batch_size in (1, 3):
        assert all(c.ok for c in graphsplit.verify(step, split, small_batch(batch_size), seed=0))


@pytest.mark.parametrize("source", ["drawn", "unanchored"])
def test_a_constant_that_needs_a_draw_stays_in_stage2_exactly(source):
    step = NullEmbedding(source)
    split = split_and_verify(step, small_batch(2))
    assert not any(spec.is_constant for spec in split.boundary.values())
    assert {"encoder.weight", "encoder.bias"} <= param_names(split.stage2, step)
    for batch_size in (1, 3):
        assert all(c.ok for c in graphsplit.verify(step, split, small_batch(batch_size), seed=0))


def test_the_report_lists_the_constant_computed_once_and_its_bytes(pix2pix):
    _, split = pix2pix
    report = split.report()
    spec = null_conditioning_spec(split)
    assert (
        "Per-dataset constants (read no batch input: cached once, not per sample; stage 2 "
        "neither holds nor runs the frozen work behind them): 1 tensors, 2.0 KiB"
    ) in report
    section = report.split("Per-dataset constants", 1)[1].splitlines()
    row = section[1]
    assert row.split()[0] == spec.name
    assert "2.0 KiB" in row and row.endswith(f"test_constant_frozen.py:{_line('# the null')}")
    assert "Not cached" not in report  # no frozen work left in stage 2
