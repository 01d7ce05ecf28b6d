"""What stage 2 of a module-level split holds and what the cache stores (``calls/usage.py``).

A VAE called as the scripts call it, ``vae.encode(x)``: its ``forward`` never runs, so the
routed calls are its ``encoder`` and its ``quant_conv``; its ``decoder`` never runs at all.
Stage 2 must hold only what it computes with, and the cache only the outputs stage 2 reads:
the ``quant_conv``'s, not the encoder's that only the cached ``quant_conv`` reads. Where the
step does read a value (a shape, a weight), it must stay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.helpers import split_and_verify

WIDTH = 4


class Autoencoder(nn.Module):
    """A frozen autoencoder: ``encode`` runs ``encoder`` then ``quant_conv``, as diffusers'
    ``AutoencoderKL.encode`` does; ``decode`` (never called by the steps) the others."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.quant_conv = nn.Linear(WIDTH, WIDTH)
        self.decoder = nn.Linear(WIDTH, WIDTH)
        self.post_quant_conv = nn.Linear(WIDTH, WIDTH)
        self.requires_grad_(False)

    def encode(self, x):
        return self.quant_conv(self.encoder(x))

    def decode(self, z):
        return self.decoder(self.post_quant_conv(z))


class Encodes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vae = Autoencoder()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.vae.encode(x)).square().mean()


X = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(0))


def _held(split) -> set[str]:
    return {name for name, _ in split.stage2.named_parameters()}


def test_stage2_holds_no_part_of_a_vae_it_only_encodes_and_stores_the_outer_output():
    split = split_and_verify(Encodes(), (X,), path="calls")
    assert _held(split) == {"head.weight", "head.bias"}
    assert list(split.boundary) == ["x__shape", "vae_quant_conv__0__out"]  # x: only the VAE
    assert split.plan.unused == {"vae"}  # its decoder never runs, its encoder is cached
    report = split.report()
    assert "not held by stage 2 (the step computes with none of their weights there): vae\n" in (
        report
    )
    assert "vae.encoder call 0: cached: its inputs are a function of the sample alone (not " in (
        report
    )
    assert split.to_json()["unused"] == ["vae"]
    other = torch.randn(2, WIDTH)
    assert torch.equal(split.stage2(**split.stage1(other)), Encodes()(other))


class ReadsTheEncoderOutput(Encodes):
    """The encoder's output is also read by the step itself: it must be stored."""

    def forward(self, x):
        h = self.vae.encoder(x)
        return self.head(self.vae.quant_conv(h) + h).square().mean()


class ReadsItsShape(Encodes):
    """Only the encoder output's shape is read outside (a reshape): its values are not
    stored, its shape is (per sample), so the shape stage 2 reads is the batch's own."""

    def forward(self, x):
        h = self.vae.encoder(x)
        rows = h.shape[0]
        return self.head(self.vae.quant_conv(h)).reshape(rows).square().mean()


def test_an_output_the_step_reads_outside_the_cached_calls_is_stored():
    split = split_and_verify(ReadsTheEncoderOutput(), (X,), path="calls")
    assert {"vae_encoder__0__out", "vae_quant_conv__0__out"} <= set(split.boundary)
    assert not split.plan.placeholders


def test_an_output_whose_shape_alone_the_step_reads_stores_its_shape_not_its_values():
    step = ReadsItsShape()
    split = split_and_verify(step, (X,), path="calls")
    assert list(split.boundary) == [
        "x__shape",  # only the VAE computes with x
        "vae_encoder__0__out__shape",
        "vae_quant_conv__0__out",
    ]
    assert split.boundary["vae_encoder__0__out__shape"].bytes_per_sample == 2 * 8
    assert not split.plan.placeholders
    other = torch.randn(5, WIDTH)  # another batch size: the stand-in has the batch's shape
    assert torch.equal(split.stage2(**split.stage1(other)), step(other))


class TiedToTheDecoder(Encodes):
    """The decoder is never called, but the step computes with its weight (a tied head)."""

    def forward(self, x):
        z = self.vae.encode(x)
        return self.head(F.linear(z, self.vae.decoder.weight)).square().mean()


def test_a_frozen_module_whose_weight_the_step_computes_with_stays_in_stage2():
    split = split_and_verify(TiedToTheDecoder(), (X,), path="calls")
    assert {"vae.decoder.weight", "vae.decoder.bias"} <= _held(split)
    assert "vae.post_quant_conv.weight" not in _held(split)


class ReadsTheDecodersDtype(Encodes):
    """Reading a weight's metadata (``vae.decoder.weight.dtype``) needs no weights."""

    def forward(self, x):
        z = self.vae.encode(x).to(self.vae.decoder.weight.dtype)
        return self.head(z).square().mean()


def test_reading_a_weights_dtype_does_not_keep_its_module():
    split = split_and_verify(ReadsTheDecodersDtype(), (X,), path="calls")
    assert _held(split) == {"head.weight", "head.bias"}


class UsesTheCachedEncodersWeight(Encodes):
    """Every call of the encoder is cached, but the step also computes with its weight."""

    def forward(self, x):
        z = self.vae.encode(x)
        return self.head(z + self.vae.encoder.weight.sum()).square().mean()


def test_a_cached_module_whose_weight_stage2_computes_with_is_held():
    split = split_and_verify(UsesTheCachedEncodersWeight(), (X,), path="calls")
    assert "vae.encoder.weight" in _held(split)
    assert "vae.encoder" not in split.plan.dropped
    assert "outside those calls, e.g. module.half() in the step): vae.encoder\n" in (split.report())
    assert split.to_json()["held_though_cached"] == ["vae.encoder"]


class MovesTheVae(Encodes):
    """diffusers' Sana script: ``vae = vae.to(accelerator.device)`` inside the loop body."""

    def forward(self, x):
        vae = self.vae.to(x.device)
        return self.head(vae.encode(x)).square().mean()


def test_a_module_the_step_moves_is_not_held_and_stage2_skips_the_move_on_meta():
    """A move to where the VAE already is computes nothing (calls/usage.py: MOVES), so stage 2
    holds none of its weights; it used to hold them all, because stage 2 runs the step's
    ``.to`` too, which a VAE on ``meta`` could not do: stage 2 now skips a move of a module it
    does not hold while that module is on meta (calls/holders.py)."""
    step = MovesTheVae()
    split = split_and_verify(step, (X,), path="calls")
    # still answered from the cache; x not stored: stage 2's stand-in answers x.device with
    # the device of its batch's other tensors (calls/unstored_inputs/)
    assert list(split.boundary) == ["x__shape", "vae_quant_conv__0__out"]
    assert "input 'x' not stored" in split.report()
    assert not any(name.startswith("vae.") for name in _held(split))
    assert split.to_json()["held_though_cached"] == []
    assert "held by stage 2 though every call" not in split.report()
    cached = split.stage1(X)
    expected = step(X)
    step.vae.to_empty(device="meta")
    assert torch.equal(split.stage2(**cached), expected)


def test_a_placeholder_is_never_read_so_stage2_runs_without_the_vaes_weights():
    """The VAE's weights moved to ``meta`` after the split: stage 2 still trains exactly."""
    step = Encodes()
    split = graphsplit.split(step, (X,), path="calls")
    cached = split.stage1(X)
    expected = step(X)
    step.vae.to_empty(device="meta")
    assert torch.equal(split.stage2(**cached), expected)
