"""Numbers cross as numbers (issue 11 item 4): a size stage 2 reads from frozen-only data is
baked into stage 2 and checked in stage 1; the tensor it was read from is not cached. Where a
cached tensor made from that data holds the number as one of its sizes, stage 2 reads it there
instead, checked in stage 1, and one plan serves every size (planning/cut/number_twins.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.errors import SplitError
from graphsplit.runtime import check_size
from tests.helpers import batch, frozen, line_of, split_and_verify
from tests.zoo.sd import build_sd_lora_step


class PixelShapedNoiseStep(nn.Module):
    """An SD LoRA step whose noise is drawn with a shape read from the raw pixels.

    Written as diffusers scripts and pipelines write it: the latent size is the image size over
    ``vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)``; ``pixel_values`` is
    otherwise read only by the frozen VAE.
    """

    def __init__(self) -> None:
        super().__init__()
        base = build_sd_lora_step()
        self.vae, self.text_encoder = base.vae, base.text_encoder
        self.unet, self.noise_scheduler = base.unet, base.scheduler
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        latents = self.vae.encode(pixel_values).latent_dist.sample()
        latents = latents * self.vae.config.scaling_factor
        encoder_hidden_states = self.text_encoder(input_ids, return_dict=False)[0]
        bsz = latents.shape[0]
        height = pixel_values.shape[2] // self.vae_scale_factor
        width = pixel_values.shape[3] // self.vae_scale_factor
        noise = torch.randn(bsz, self.unet.config.in_channels, height, width, device=latents.device)
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        model_pred = self.unet(noisy_latents, timesteps, encoder_hidden_states).sample
        return F.mse_loss(model_pred.float(), noise.float(), reduction="mean")


class PyramidNoiseStep(PixelShapedNoiseStep):
    """Noise drawn at the pixels' resolution and pooled to the latents' (as multi-resolution
    noise is drawn): no cached tensor made from the pixels holds their size, so stage 2 holds
    it as a literal, checked in stage 1."""

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        latents = self.vae.encode(pixel_values).latent_dist.sample()
        latents = latents * self.vae.config.scaling_factor
        encoder_hidden_states = self.text_encoder(input_ids, return_dict=False)[0]
        bsz = latents.shape[0]
        height = pixel_values.shape[2]
        width = pixel_values.shape[3]
        noise = torch.randn(bsz, self.unet.config.in_channels, height, width, device=latents.device)
        noise = F.avg_pool2d(noise, self.vae_scale_factor) * self.vae_scale_factor
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        model_pred = self.unet(noisy_latents, timesteps, encoder_hidden_states).sample
        return F.mse_loss(model_pred.float(), noise.float(), reduction="mean")


def sd_batch(size: int, resolution: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.rand(size, 3, resolution, resolution, generator=generator) * 2 - 1
    return pixels, torch.randint(0, 990, (size, 16), generator=generator)


@pytest.fixture(scope="module")
def pixel_step() -> tuple[PyramidNoiseStep, graphsplit.Split]:
    step = PyramidNoiseStep()
    split = split_and_verify(step, sd_batch(2))
    split.plan_set.max_plans = 1  # another resolution is refused, not given a plan of its own
    return step, split


def test_the_raw_pixels_are_not_cached_for_their_shape(pixel_step):
    _, split = pixel_step
    assert "pixel_values" not in split.boundary
    assert {key: spec.bytes_per_sample for key, spec in split.boundary.items()} == {
        "vae_encode_latent_dist_parameters": 8 * 16 * 16 * 4,
        "text_encoder_0": 16 * 32 * 4,
    }
    baked = {node.name: value for node, value in split.cut.baked.items()}
    assert baked == {"shape_2": 32, "shape_3_3": 32} and not split.cut.number_twins
    assert "torch.randn((mul_shape_0, 4, 32, 32)" in split.stage2.code
    assert "pixel_values" not in split.stage2.code


def test_a_size_the_latents_hold_is_read_off_them_and_one_plan_serves_every_resolution():
    """``pixel_values.shape[2] // vae_scale_factor`` is the latents' height: stage 2 reads it
    as ``latents.size(2)`` (the noise's index 2 of 4 says which of the two equal sizes), stage
    1 checks the two agree, and 64 x 48 pixels train exactly on the plan made at 32 x 32."""
    step = PixelShapedNoiseStep()
    split = split_and_verify(step, sd_batch(2))
    split.plan_set.max_plans = 1  # a second plan would be refused
    assert "pixel_values" not in split.boundary and not split.cut.baked
    twins = {n.name: (twin.name, dim) for n, (twin, dim) in split.cut.number_twins.items()}
    latents = "vae_encode_latent_dist_parameters"
    assert twins == {"floordiv": (latents, 2), "floordiv_1": (latents, 3)}
    assert f"floordiv = {latents}.size(2)" in split.stage2.code
    assert split.stage1.code.count("graphsplit_runtime_check_same_read(") == 2
    assert "Sizes stage 2 reads off a cached tensor" in split.report()
    assert f"pixel_values.shape[3] // 2{' ' * 15}read as {latents}.shape[3]" in split.report()
    pixels, ids = sd_batch(2, seed=1)
    checks = graphsplit.verify(step, split, (F.interpolate(pixels, (64, 48)), ids), seed=0)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert len(split.plans) == 1


def test_verify_is_exact_at_another_batch_size(pixel_step):
    step, split = pixel_step
    comparisons = graphsplit.verify(step, split, sd_batch(3, seed=1), seed=0)
    assert comparisons and all(comparison.ok for comparison in comparisons)


def test_a_plan_traced_at_batch_3_is_exact_and_caches_no_pixels_either():
    step = PyramidNoiseStep()
    split = split_and_verify(step, sd_batch(3, seed=2))
    assert "pixel_values" not in split.boundary
    assert sorted(node.name for node in split.cut.baked) == ["shape_2", "shape_3_3"]


def test_the_report_and_plan_show_the_baked_numbers(pixel_step):
    _, split = pixel_step
    report = split.report()
    assert "Boundary: 2 tensors, 10.0 KiB per sample" in report
    assert "Numbers baked into stage 2 (not cached; stage 1 checks them on every batch):" in report
    assert "pixel_values.shape[2] = 32" in report
    numbers = split.to_json()["baked_numbers"]
    assert [(n["node"], n["expression"], n["value"]) for n in numbers] == [
        ("shape_2", "pixel_values.shape[2]", 32),
        ("shape_3_3", "pixel_values.shape[3]", 32),
    ]


def test_stage_1_at_another_resolution_names_the_size_the_line_and_the_fix(pixel_step):
    _, split = pixel_step
    with pytest.raises(SplitError) as caught:
        split.stage1(*sd_batch(2, resolution=64))
    message = str(caught.value)
    assert (
        "this plan was made for pixel_values.shape[2] = 32, got 64: the batch needs a plan of "
        "its own, and graphsplit.split has made max_plans=1 plan(s) already" in message
    )
    assert line_of(PyramidNoiseStep.forward, "height = pixel_values.shape[2]") in message
    assert "fix:    pass a larger max_plans to graphsplit.split" in message


def test_stage_1_checks_the_sizes_before_it_runs_the_frozen_encoders(pixel_step):
    _, split = pixel_step
    code = split.stage1.code
    assert code.index("graphsplit_runtime_check_size(") < code.index("vae.encode(")


# -- small steps: which numbers are baked, and how ------------------------------------------
class SizedNoise(nn.Module):
    """A frozen encoder, a trainable head, and noise shaped by ``size_of(pixels, latents)``."""

    def __init__(self, size_of) -> None:
        super().__init__()
        self.encoder = frozen(nn.Conv2d(3, 4, 3, padding=1))
        self.head = nn.Conv2d(4, 4, 1)
        self.size_of = size_of

    def forward(self, pixels):
        latents = self.encoder(pixels)
        noise = torch.randn(*self.size_of(pixels, latents))
        return F.mse_loss(self.head(latents + noise), noise)


def test_a_size_stage_2_can_read_itself_is_not_baked():
    model = SizedNoise(lambda pixels, latents: latents.shape)
    split = split_and_verify(model, (batch(2, 3, 8, 8),))
    assert not split.cut.baked
    assert "Numbers baked" not in split.report()


class SizedNoiseAtHalfResolution(nn.Module):
    """Noise of the pixels' size, the encoder halving it: no cached tensor has that size."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Conv2d(3, 4, 3, padding=1, stride=2))
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, pixels):
        latents = self.encoder(pixels)
        noise = torch.randn(*(latents.shape[:2] + pixels.shape[2:]))
        return F.mse_loss(self.head(latents), noise[:, :, ::2, ::2])


def test_a_torch_size_is_baked_as_a_torch_size():
    split = split_and_verify(SizedNoiseAtHalfResolution(), (batch(2, 3, 8, 8),))
    split.plan_set.max_plans = 1  # refuse another size, make no plan for it
    assert list(split.boundary) == ["encoder"]
    assert [(node.name, value) for node, value in split.cut.baked.items()] == [
        ("getitem_1", torch.Size([8, 8]))
    ]
    assert "torch.Size([8, 8])" in split.stage2.code
    with pytest.raises(SplitError, match=r"made for pixels.shape\[2:\] = \(8, 8\), got \(8, 6\)"):
        split.stage1(batch(2, 3, 8, 6))


def test_a_size_of_the_input_a_cached_tensor_shares_is_read_off_it():
    """``pixels.shape[2:]`` is the latents' size too (a padded 3x3 convolution): stage 2 reads
    it off the cached latents, stage 1 checks the two agree, and one plan serves 8x6 as well
    (planning/cut/twin_reads.py)."""
    model = SizedNoise(lambda pixels, latents: latents.shape[:2] + pixels.shape[2:])
    split = split_and_verify(model, (batch(2, 3, 8, 8),))
    split.plan_set.max_plans = 1
    assert list(split.boundary) == ["encoder"] and not split.cut.baked
    assert "encoder.shape" in split.stage2.code and "check_same_read" in split.stage1.code
    checks = graphsplit.verify(model, split, (batch(2, 3, 8, 6),), seed=1)
    assert checks and all(c.ok for c in checks)
    assert len(split.plans) == 1


def test_an_int_the_trace_read_from_a_raw_input_is_rechecked_in_stage_1():
    class ScaledByWidth(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = frozen(nn.Conv2d(3, 4, 3, padding=1))
            self.head = nn.Linear(4, 4)

        def forward(self, pixels):
            latents = self.encoder(pixels).mean((2, 3))
            return self.head(latents).sum() * int(pixels.shape[3])

    model = ScaledByWidth()
    split = split_and_verify(model, (batch(2, 3, 8, 8),))
    split.plan_set.max_plans = 1  # refuse another size, make no plan for it
    assert list(split.boundary) == ["mean"]
    assert "check_size" in split.stage1.code
    # Stage 2 holds 8 as a literal: without the stage-1 check, 6-pixel-wide images would be
    # scaled by 8 silently.
    with pytest.raises(SplitError) as caught:
        split.stage1(batch(2, 3, 8, 6))
    assert "this plan was made for pixels.shape[3] = 8, got 6" in str(caught.value)
    assert line_of(ScaledByWidth.forward, "int(pixels.shape[3])") in str(caught.value)


def test_an_int_argument_of_the_step_is_not_baked_it_may_change_every_call():
    class ScaledByArgument(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = frozen(nn.Linear(4, 4))
            self.head = nn.Linear(4, 4)

        def forward(self, x, global_step: int):
            return self.head(self.encoder(x)).sum() * global_step

    with pytest.raises(SplitError) as caught:
        graphsplit.split(ScaledByArgument(), (batch(2, 4), 3), path="trace")
    message = str(caught.value)
    assert "Stage 2 needs this value, a builtins.int, but it is not a tensor" in message
    assert "global_step" in message


def test_check_size_compares_tuples():
    assert check_size(torch.Size([4, 4]), (4, 4), "x.shape[2:]", "step.py:3") == (4, 4)
    with pytest.raises(SplitError, match=r"made for x.shape\[2:\] = \(4, 4\), got \(4, 2\)"):
        check_size(torch.Size([4, 2]), (4, 4), "x.shape[2:]", "step.py:3")


def test_stage_1_code_names_no_file_the_checks_read_their_lines_beside_it(pixel_step):
    _, split = pixel_step
    # Stage 1's code is fingerprinted: a path or line number in it would make a cache stale
    # when the script moves or gains a line.
    assert "test_numbers.py" not in split.stage1.code
    assert "graphsplit_check_sources[0]" in split.stage1.code
    height, width = split.stage1.graphsplit_check_sources
    assert line_of(PyramidNoiseStep.forward, "height = pixel_values.shape[2]") in height
    assert line_of(PyramidNoiseStep.forward, "width = pixel_values.shape[3]") in width


def test_saved_stage_1_code_checks_the_baked_numbers(pixel_step, tmp_path):
    import importlib.util

    _, split = pixel_step
    folder = split.save_code(tmp_path / "code")
    spec = importlib.util.spec_from_file_location("saved_numbers_stage1", folder / "stage1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stage1 = module.Stage1(split.stage1)
    example = sd_batch(2)
    saved, live = stage1(*example), split.stage1(*example)
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in live)
    with pytest.raises(SplitError, match=r"made for pixel_values.shape\[2\] = 32, got 64"):
        stage1(*sd_batch(2, resolution=64))


def test_the_cache_holds_no_pixels_and_stage_2_trains_from_it_exactly(pixel_step, tmp_path):
    from torch.utils.data import DataLoader

    step, split = pixel_step
    batches = [dict(zip(("pixel_values", "input_ids"), sd_batch(2, seed=seed))) for seed in (3, 4)]
    graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    cached = DataLoader(
        graphsplit.CachedDataset(tmp_path / "cache", split),
        batch_size=2,
        collate_fn=graphsplit.collate,
    )
    for seed, (batch_, cached_batch) in enumerate(zip(batches, cached, strict=True)):
        assert "pixel_values" not in cached_batch
        torch.manual_seed(seed)
        expected = step(**batch_)
        torch.manual_seed(seed)
        assert torch.equal(split.stage2(**cached_batch), expected)


def test_caching_a_batch_at_another_resolution_stops_before_writing_it(pixel_step, tmp_path):
    _, split = pixel_step
    batches = [dict(zip(("pixel_values", "input_ids"), sd_batch(2, resolution=64)))]
    with pytest.raises(SplitError, match=r"made for pixel_values.shape\[2\] = 32, got 64"):
        graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
