"""Real diffusers / transformers / peft training steps, split as users write them (issue 3).

Every model is a real library class built from a tiny config with random weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.helpers import param_names, split_and_verify

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.zoo import (
    CaptionedImages,
    build_partial_encoder_lora_step,
    build_sd_lora_step,
    build_textual_inversion_step,
)


def _batch(size: int = 2, resolution: int = 32, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = CaptionedImages(length=size, resolution=resolution, **kwargs)
    items = [dataset[index] for index in range(size)]
    return (
        torch.stack([item["pixel_values"] for item in items]),
        torch.stack([item["input_ids"] for item in items]),
    )


@pytest.fixture(scope="module")
def sd_step():
    return build_sd_lora_step(seed=0)


@pytest.fixture(scope="module")
def sd_split(sd_step):
    return split_and_verify(sd_step, _batch())


def test_sd_lora_boundary_is_latent_distribution_and_text_embedding(sd_split):
    assert list(sd_split.boundary) == ["vae_encode_latent_dist_parameters", "text_encoder_0"]
    latent = sd_split.boundary["vae_encode_latent_dist_parameters"]
    assert latent.shape == (2, 8, 16, 16) and latent.batch_dim == 0  # mean and log-variance
    assert latent.bytes_per_sample == 8 * 16 * 16 * 4
    assert latent.source.startswith("tests/zoo/sd.py:")
    text = sd_split.boundary["text_encoder_0"]
    assert text.shape == (2, 16, 32) and text.batch_dim == 0


def test_sd_lora_stage2_holds_no_vae_or_text_encoder_parameter(sd_step, sd_split):
    held = param_names(sd_split.stage2, sd_step)
    assert held and all(name.startswith("unet.") for name in held)
    assert not any(name.startswith(("vae.", "text_encoder.")) for name in held)
    assert param_names(sd_split.stage1, sd_step).isdisjoint(sd_split.trainable)


def test_sd_lora_random_draws_stay_in_stage2_in_order(sd_split):
    code = sd_split.stage2.code
    sample, noise, timesteps = (code.index(s) for s in (".sample()", "randn_like(", "randint("))
    assert sample < noise < timesteps
    report = sd_split.report()
    assert "Random draws kept in stage 2" in report and "aten.randint" in report
    assert "frozen parameters stage 2 does not need" in report


def test_sd_lora_grads_land_on_peft_names(sd_step, sd_split):
    pixels, ids = _batch()
    for param in sd_step.parameters():
        param.grad = None
    torch.manual_seed(0)
    sd_split.stage2(**sd_split.stage1(pixels, ids)).backward()
    with_grad = {name for name, p in sd_step.named_parameters() if p.grad is not None}
    assert with_grad == set(sd_split.trainable)
    assert all(".lora_A." in name or ".lora_B." in name for name in with_grad)
    assert with_grad <= {name for name, _ in sd_split.stage2.named_parameters()}


def _checkpoint_calls(stage2, boundary, monkeypatch) -> int:
    """How many times stage 2's forward + backward goes through torch.utils.checkpoint."""
    calls = []
    original = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.utils.checkpoint, "checkpoint", counting)
        torch.manual_seed(0)
        stage2(**boundary).backward()
    return len(calls)


def test_gradient_checkpointing_stays_in_effect_in_stage2(sd_split, monkeypatch):
    step = build_sd_lora_step(seed=0, gradient_checkpointing=True)
    split = split_and_verify(step, _batch())
    assert split.stage2.unet is step.unet and step.unet.is_gradient_checkpointing
    assert _checkpoint_calls(split.stage2, split.stage1(*_batch()), monkeypatch) > 0
    assert _checkpoint_calls(sd_split.stage2, sd_split.stage1(*_batch()), monkeypatch) == 0


def test_frozen_modules_on_meta_split_and_stage2_trains(sd_split):
    real = build_sd_lora_step(seed=0)
    lean = build_sd_lora_step(seed=0, frozen_on_meta=True)
    assert all(p.is_meta for p in lean.vae.parameters())
    lean_split = graphsplit.split(lean, _batch())
    assert list(lean_split.boundary) == list(sd_split.boundary)
    assert lean_split.stage2.code == sd_split.stage2.code
    boundary = graphsplit.split(real, _batch()).stage1(*_batch())
    torch.manual_seed(0)
    expected = real(*_batch())
    expected.backward()
    torch.manual_seed(0)
    loss = lean_split.stage2(**boundary)
    loss.backward()
    assert torch.equal(loss, expected)
    real_grads = {n: p.grad for n, p in real.named_parameters() if p.requires_grad}
    lean_grads = {n: p.grad for n, p in lean.named_parameters() if p.requires_grad}
    assert real_grads.keys() == lean_grads.keys()
    assert all(torch.equal(real_grads[n], lean_grads[n]) for n in real_grads)
    with pytest.raises(graphsplit.MetaParameterError, match="meta device") as error:
        lean_split.stage1(*_batch())
    assert "fix:" in str(error.value)


def test_trainable_modules_on_meta_still_split_and_stage1_runs(sd_split):
    lean = build_sd_lora_step(seed=0, trainable_on_meta=True)
    lean_split = graphsplit.split(lean, _batch())
    expected = sd_split.stage1(*_batch())
    actual = lean_split.stage1(*_batch())
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


def test_partial_encoder_lora_caches_inside_the_encoder():
    step = build_partial_encoder_lora_step(seed=0)
    ids = _batch()[1]
    split = split_and_verify(step, (ids, torch.randn(2, 8)))
    assert "text_encoder_encoder_layers_1" in split.boundary  # hidden states before layer 2
    held = param_names(split.stage2, step)
    early = (
        "text_encoder.embeddings.",
        "text_encoder.encoder.layers.0.",
        "text_encoder.encoder.layers.1.",
    )
    assert not any(name.startswith(early) for name in held)
    assert any(name.startswith("text_encoder.encoder.layers.3.") for name in held)
    assert "traced into text_encoder" in split.report()


def test_textual_inversion_caches_only_the_vae_side():
    step = build_textual_inversion_step(seed=0)
    pixels, ids = _batch(placeholder_ids=(1000,))
    split = split_and_verify(step, (pixels, ids))
    assert "vae_encode_latent_dist_parameters" in split.boundary
    held = param_names(split.stage2, step)
    assert not any(name.startswith("vae.") for name in held)
    assert any(name.startswith("text_encoder.encoder.") for name in held)  # grads flow through
    assert any(name.startswith("unet.") for name in held)


def test_torch_compile_runs_stage2(sd_split):
    pixels, ids = _batch()
    boundary = sd_split.stage1(pixels, ids)
    compiled = torch.compile(sd_split.stage2, backend="aot_eager")
    torch.manual_seed(0)
    expected = sd_split.stage2(**boundary)
    torch.manual_seed(0)
    assert torch.equal(compiled(**boundary), expected)


class FrozenDropoutEncoder(nn.Module):
    """A frozen encoder left in train mode with active dropout: the classic trap."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


class FrozenBatchNormEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


@pytest.mark.parametrize(
    ("model_type", "words"),
    [(FrozenDropoutEncoder, "draws random numbers"), (FrozenBatchNormEncoder, "mixes samples")],
)
def test_traps_are_reported_not_cached(model_type, words):
    model = model_type().train()
    split = split_and_verify(model, (torch.randn(4, 8),))
    report = split.report()
    assert "Not cached" in report and words in report
    assert "call encoder.eval() to make it cacheable" in report
    assert "encoder" not in split.boundary
    model.eval()
    cached = split_and_verify(model, (torch.randn(4, 8),))
    assert "encoder" in cached.boundary


def test_batch_of_one_caches_the_text_encoder_too():
    """At batch 1 kernels dispatch other ops (views for copies); that is not batch mixing."""
    step = build_sd_lora_step(seed=0)
    split = split_and_verify(step, _batch(size=1))
    assert list(split.boundary) == ["vae_encode_latent_dist_parameters", "text_encoder_0"]
