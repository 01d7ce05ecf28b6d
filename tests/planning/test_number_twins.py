"""A number the cut would bake is read as an equal size of a cached tensor made from its source.

DiffSynth's Wan step draws its noise as ``randn((1, z_dim, (num_frames - 1) // 4 + 1,
height // 8, width // 8))`` from the raw video, which stage 2 does not have; the cached
latents, the encoder's output for that video, have exactly those sizes. Stage 2 reads each
number as a size of the latents, and stage 1 checks on every batch that the number the step
computes and that size agree (graphsplit/planning/cut/number_twins.py): one plan for every
frame count and resolution, and a batch where the two differ gets a plan of its own.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.errors import SplitError
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.helpers import line_of, split_and_verify


class NoiseFromTheRawVideo(nn.Module):
    """Wan in miniature: a frozen encoder keeps every fourth frame (the first one's too) and
    patches 8 x 8 pixels; the noise is drawn with the latents' sizes computed from the video's,
    as DiffSynth computes them."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Conv3d(3, channels, (1, 8, 8), stride=(1, 8, 8)).requires_grad_(False)
        self.head = nn.Conv3d(channels, channels, 1)

    def noise_shape(self, video: torch.Tensor) -> tuple[int, ...]:
        batch, _, frames, height, width = video.shape
        channels = self.head.in_channels
        return (batch, channels, (frames - 1) // 4 + 1, height // 8, width // 8)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(video[:, :, ::4])
        noise = torch.randn(self.noise_shape(video))
        return F.mse_loss(self.head(latents + 0.5 * noise), noise)


class ScaledByTheHeight(NoiseFromTheRawVideo):
    """A loss scaled by ``height // 8``, a number given to no shape: at a square example the
    latents (4 channels) hold it at three indices, and nothing says which."""

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(video[:, :, ::4])
        return self.head(latents).square().mean() * (video.shape[3] // 8)


class ScaledByAQuarterOfTheHeight(NoiseFromTheRawVideo):
    """``height // 4`` is no size of the latents; at 32 pixels it is 8, their channel count."""

    def __init__(self) -> None:
        super().__init__(channels=8)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(video[:, :, ::4])
        scale = video.shape[3] // 4
        return self.head(latents).square().mean() * scale


class NoiseAsLongAsThePrompt(nn.Module):
    """Noise with one row per video frame, the prompt as long as the clip: the prompt's
    embedding, cached apart from the pooled video, has the frame count but is not made from
    the video."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Conv3d(3, 4, (1, 8, 8), stride=(1, 8, 8)).requires_grad_(False)
        self.tokens = nn.Embedding(16, 4).requires_grad_(False)
        self.head = nn.Linear(4, 4)

    def forward(self, video: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.encoder(video).mean((2, 3, 4))  # (B, 4)
        prompt = self.tokens(ids)  # (B, L, 4)
        noise = torch.randn(video.shape[2], 4)
        return (self.head(prompt) + noise).square().mean() + self.head(pooled).square().mean()


def _video(frames: int, height: int = 32, width: int = 32, size: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(size, 3, frames, height, width, generator=generator) * 2 - 1


def _twins(split: graphsplit.Split) -> dict[str, tuple[str, int]]:
    return {n.name: (twin.name, dim) for n, (twin, dim) in split.cut.number_twins.items()}


def test_the_noise_shape_is_read_off_the_latents_and_one_plan_serves_every_size():
    step = NoiseFromTheRawVideo()
    split = split_and_verify(step, (_video(5),))
    assert not split.cut.baked
    # A square example: h // 8 and w // 8 are both 4; the shape given to randn tells them apart.
    assert sorted(dim for _, dim in _twins(split).values()) == [2, 3, 4]
    assert {twin for twin, _ in _twins(split).values()} == {"encoder"}
    code = split.stage2.code
    assert all(f"encoder.size({dim})" in code for dim in (2, 3, 4)), code
    assert split.stage1.code.count("graphsplit_runtime_check_same_read(") == 3
    for seed, (frames, height, width) in enumerate([(9, 32, 48), (2, 16, 16), (13, 64, 32)]):
        checks = graphsplit.verify(step, split, (_video(frames, height, width, 3),), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert len(split.plans) == 1


def test_the_signature_names_the_size_each_number_is_read_off():
    split = graphsplit.split(NoiseFromTheRawVideo(), (_video(5),))
    values = split.plans[0].signature.as_dict()
    read_off = {what: value["read off"] for what, value in values.items() if "read off" in value}
    assert sorted(read_off) == [
        "((video.shape[2] - 1) // 4) + 1",
        "video.shape[3] // 8",
        "video.shape[4] // 8",
    ]
    assert [text.rsplit(".shape", 1)[1] for text in sorted(read_off.values())] == [
        "[2]",
        "[3]",
        "[4]",
    ]


def test_a_number_given_to_no_shape_stays_baked_where_two_sizes_equal_it():
    step = ScaledByTheHeight()
    square = split_and_verify(step, (_video(5),))  # 4 channels, 4 high, 4 wide
    assert [(n.name, v) for n, v in square.cut.baked.items()] == [("floordiv", 4)]
    assert not square.cut.number_twins
    tall = split_and_verify(step, (_video(5, 48, 32),))  # 6 high, 4 wide: one size is 6
    assert not tall.cut.baked and _twins(tall) == {"floordiv": ("encoder", 3)}
    assert all(c.ok for c in graphsplit.verify(step, tall, (_video(5, 64, 48),), seed=1))
    assert len(tall.plans) == 1


def test_a_twin_chosen_by_coincidence_costs_a_plan_never_a_wrong_value():
    step = ScaledByAQuarterOfTheHeight()
    split = split_and_verify(step, (_video(5),))
    assert _twins(split) == {"floordiv": ("encoder", 1)}  # the 8 channels, by coincidence
    for seed, height in enumerate((64, 32, 48, 64)):
        checks = graphsplit.verify(step, split, (_video(5, height),), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    # One plan per height, as baking it would have made: the later ones hold it as a literal.
    assert len(split.plans) == 3
    assert all(plan.cut.baked and not plan.cut.number_twins for plan in split.plans[1:])


def test_stage_1_names_the_number_its_twin_and_the_line_where_they_differ():
    step = ScaledByAQuarterOfTheHeight()
    split = graphsplit.split(step, (_video(5),), max_plans=1)
    with pytest.raises(SplitError) as caught:
        split.stage1(_video(5, 64))
    message = str(caught.value)
    assert (
        "this plan reads video.shape[3] // 4 off encoder.shape[1] in stage 2, and for this "
        "batch they differ (16 against 8): the batch needs a plan of its own" in message
    )
    assert line_of(ScaledByAQuarterOfTheHeight.forward, "scale = video.shape[3] // 4") in message
    assert "fix:    pass a larger max_plans to graphsplit.split" in message


def test_a_tensor_not_made_from_the_source_is_no_twin():
    step = NoiseAsLongAsThePrompt()
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    split = split_and_verify(step, (_video(5), ids))  # the prompt's embedding is (2, 5, 4)
    assert sorted(split.boundary) == ["mean", "tokens"]
    assert [(n.name, v) for n, v in split.cut.baked.items()] == [("shape_2", 5)]
    assert not split.cut.number_twins


def test_a_number_below_two_stays_baked():
    split = split_and_verify(NoiseFromTheRawVideo(), (_video(2, 32, 48),))  # (2 - 1) // 4 + 1
    assert [(n.name, v) for n, v in split.cut.baked.items()] == [("add", 1)]
    assert sorted(dim for _, dim in _twins(split).values()) == [3, 4]


class ScaledByTheWidthLessOne(NoiseFromTheRawVideo):
    def forward(self, video: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(video[:, :, ::4])
        return self.head(latents).square().mean() * (video.shape[4] // 8 - 1)


def test_the_batch_dim_is_never_a_twin():
    """At 32 pixels ``width // 8 - 1`` is 3, the example's batch size: batches of other sizes
    must not make it another number, so it stays baked."""
    split = split_and_verify(ScaledByTheWidthLessOne(), (_video(5, size=3),))
    assert [(n.name, v) for n, v in split.cut.baked.items()] == [("sub", 3)]
    assert not split.cut.number_twins


def test_saved_code_reads_the_numbers_off_the_twin_and_checks_them(tmp_path):
    step = NoiseFromTheRawVideo()
    split = graphsplit.split(step, (_video(5),))
    folder = split.save_code(tmp_path / "code")
    stages = {}
    for name in ("stage1", "stage2"):
        spec = importlib.util.spec_from_file_location(f"saved_twins_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        stages[name] = getattr(module, name.capitalize())(getattr(split, name))
    video = _video(9, 48, 32, seed=3)
    with torch.no_grad():
        boundary = stages["stage1"](video)
    torch.manual_seed(5)
    saved = stages["stage2"](**boundary)
    torch.manual_seed(5)
    assert torch.equal(saved, step(video))


def test_a_cache_of_many_frame_counts_under_one_plan_trains_exactly(tmp_path):
    step = NoiseFromTheRawVideo()
    split = graphsplit.split(step, (_video(5),))
    raw = [
        {"video": _video(frames, height, 32, seed=frames), "key": [f"{frames}a", f"{frames}b"]}
        for frames, height in ((5, 32), (9, 48), (1, 32), (13, 16))
    ]
    params = [step.head.weight]
    assert_cache_round_trip(split, lambda b: step(b["video"]), raw, tmp_path / "cache", params)
    assert len(split.plans) == 1


@settings(max_examples=10, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(2, 13), st.sampled_from([8, 16, 32]), st.sampled_from([8, 24])),
        min_size=1,
        max_size=3,
    )
)
def test_any_sizes_are_exact_under_the_first_plan(sizes):
    step = NoiseFromTheRawVideo()
    split = graphsplit.split(step, (_video(5),))
    for seed, (frames, height, width) in enumerate(sizes):
        video = _video(frames, height, width, 1 + seed % 2, seed)
        checks = graphsplit.verify(step, split, (video,), seed=seed)
        assert checks and all(c.ok for c in checks)
    assert len(split.plans) == 1
