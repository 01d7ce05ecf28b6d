"""A bfloat16 frozen call run alone: its row may move by one step of the dtype, not more.

The module-level path caches a call with a batched input once the last sample, run alone,
gives that sample's row of the batch. A CPU conv computes a row alone with another blocking of
the same sums than in a batch: in float32 that moves the last bits (rtol 1e-4 holds); in
bfloat16 (a diffusers script's ``vae.to(dtype=weight_dtype)``) it moves a value by one step of
the dtype, which a fixed 1e-4 called "mixes samples" and left the VAE in stage 2. The
tolerance of a half-precision output is two steps of its dtype (graphsplit/batch_invariance.py
``alone_tolerances``); a call that mixes samples still differs far beyond it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.batch_invariance import ALONE_ATOL, ALONE_RTOL, alone_tolerances
from graphsplit.calls import Verdict
from graphsplit.calls.row_folds import rows_not_following


def test_the_tolerances_follow_the_dtype():
    values = torch.tensor([[0.5, -1.5], [0.25, 1.0]])
    step = torch.finfo(torch.bfloat16).eps
    assert alone_tolerances(values) == (ALONE_RTOL, ALONE_ATOL)
    assert alone_tolerances(values.double()) == (ALONE_RTOL, ALONE_ATOL)
    assert alone_tolerances(values.long()) == (ALONE_RTOL, ALONE_ATOL)
    assert alone_tolerances(values.bfloat16()) == (2 * step, 2 * step * 1.5)
    half = torch.finfo(torch.float16).eps
    assert alone_tolerances(values.half()) == (2 * half, 2 * half * 1.5)


def test_a_row_one_step_off_follows_and_a_mixed_row_does_not():
    batch = torch.tensor([[0.5, 1.0, -0.75, 0.125], [1.0, 0.5, 0.25, -1.0]], dtype=torch.bfloat16)
    step = torch.finfo(torch.bfloat16).eps
    one_step = batch[-1:].clone()
    one_step[0, 1] += step * 0.5  # 0.5 + a step of its binade: the next bfloat16 value
    assert one_step[0, 1] != batch[-1, 1]
    assert rows_not_following({"out": batch}, {"out": one_step}, (-1,), exact=False) == ""
    mixed = batch[-1:] - batch.float().mean(0, keepdim=True).bfloat16()
    assert rows_not_following({"out": batch}, {"out": mixed}, (-1,), exact=False) == "out"
    # Bit for bit where it must be (a reordered batch at the example's own size).
    assert rows_not_following({"out": batch}, {"out": one_step}, (-1,)) == "out"


def movq() -> nn.Module:
    """diffusers' VQModel (Kandinsky 2.2's MoVQ) from its tiny test config."""
    import diffusers

    torch.manual_seed(0)
    return diffusers.VQModel(
        block_out_channels=[32, 64],
        down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
        in_channels=3,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        norm_type="spatial",
        num_vq_embeddings=12,
        out_channels=3,
        up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
        vq_embed_dim=4,
    )


class MixesTheBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, pixels):
        hidden = self.conv(pixels)
        return hidden - hidden.mean(0, keepdim=True)


class Step(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vae = encoder.to(torch.bfloat16).requires_grad_(False)
        self.movq = not isinstance(encoder, MixesTheBatch)
        channels = 4 if self.movq else 3
        self.head = nn.Conv2d(channels, channels, 1)

    def forward(self, pixels, target):
        images = pixels.to(torch.bfloat16)
        latents = self.vae.encode(images).latents if self.movq else self.vae(images)
        return F.mse_loss(self.head(latents.float()), target)


def _batch(size: int, channels: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(size, 3, 32, 32, generator=generator)
    side = 16 if channels == 4 else 32
    return pixels, torch.randn(size, channels, side, side, generator=generator)


def test_a_bfloat16_conv_encoder_is_cached(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step = Step(movq())
        example = _batch(3, 4)
        # The premise: the last sample alone is not its row of the batch bit for bit.
        with torch.no_grad():
            pixels = example[0].to(torch.bfloat16)
            alone, whole = step.vae.encode(pixels[-1:]), step.vae.encode(pixels)
            assert not torch.equal(whole.latents[-1:], alone.latents)
        split = graphsplit.split(step, example, path="calls")
        verdicts = {v.path: v.verdict for v in split.plan.verdicts}
        assert verdicts == {"vae.encoder": Verdict.CACHED, "vae.quant_conv": Verdict.CACHED}
        assert not [name for name, _ in split.stage2.named_parameters() if name.startswith("vae")]
        for batch in (example, _batch(2, 4, seed=1)):
            checks = graphsplit.verify(step, split, batch)
            assert checks and all(check.ok for check in checks)
        batches = [example, _batch(2, 4, seed=1)]
        loader = [
            {"pixels": pixels, "target": target, "key": [f"b{i}s{j}" for j in range(len(pixels))]}
            for i, (pixels, target) in enumerate(batches)
        ]
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
        rows = graphsplit.CachedDataset(tmp_path / "cache", split)
        start = 0
        for pixels, target in batches:
            cached = graphsplit.collate([rows[start + j] for j in range(len(pixels))])
            start += len(pixels)
            assert torch.equal(split.stage2(**cached), step(pixels, target))
    finally:
        torch.set_num_threads(threads)


def test_a_bfloat16_call_that_mixes_the_batch_is_still_not_cached():
    step = Step(MixesTheBatch())
    with pytest.raises(graphsplit.SplitError) as refusal:
        graphsplit.split(step, _batch(3, 3), path="calls")
    assert f"vae call 0: {Verdict.MIXES_SAMPLES.why}" in str(refusal.value)
