"""A batch that is one dataset item as it is: PIL images and strings cross per sample.

DiffSynth-Studio's loader (``collate_fn=lambda x: x[0]``) hands the step ``{"image": PIL.Image,
"prompt": str}``; the step itself turns the pixels into a tensor and the prompt into ids. The
module-level path must cache the frozen calls of *every* sample under one plan: the images
cross as their pixels, the string as its code points, and stage 2 gives the step the same
image and string back (:mod:`graphsplit.planning.step.raw_samples`).
"""

from __future__ import annotations

import numpy
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.calls.call_plan import input_spec
from graphsplit.planning.step.raw_samples import decode_images, encode_images, is_raw_sample
from tests.conformance.unseen2_data_checks import assert_same_step

Image = pytest.importorskip("PIL.Image")

WORDS = {"a": 1, "cat": 2, "dog": 3, "sits": 4, "runs": 5}


def picture(seed: int, size: int = 8, mode: str = "RGB") -> Image.Image:
    pixels = numpy.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=numpy.uint8)
    return Image.fromarray(pixels).convert(mode)


class RawSampleStep(nn.Module):
    """A DiffSynth-like ``forward(data)``: preprocessing and tokenizing in the step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vae = nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        self.text_encoder = nn.Embedding(8, 4).requires_grad_(False)
        self.denoiser = nn.Linear(4, 4)

    def forward(self, data):
        frames = data["video"] if "video" in data else [data["image"]]
        pixels = torch.stack(
            [
                torch.from_numpy(numpy.array(frame)).permute(2, 0, 1).float() / 255
                for frame in frames
            ]
        )
        latents = self.vae(pixels).mean(dim=(0, 2, 3))
        ids = torch.tensor([[WORDS.get(word, 0) for word in data["prompt"].split()]])
        context = self.text_encoder(ids).mean(dim=1)[0]
        noise = torch.randn_like(latents)
        return (self.denoiser(latents + noise + context) - noise).pow(2).mean()


def samples(count: int, **extra) -> list[dict]:
    prompts = ["a cat sits", "a dog runs", "a cat"]
    return [{"image": picture(seed), "prompt": prompts[seed % 3], **extra} for seed in range(count)]


def trainable(step: nn.Module) -> list[nn.Parameter]:
    return [p for p in step.parameters() if p.requires_grad]


def test_a_raw_sample_is_images_and_no_tensor():
    assert is_raw_sample({"image": picture(0), "prompt": "a cat"})
    assert is_raw_sample({"video": [picture(0), picture(1)], "prompt": "a cat"})
    assert not is_raw_sample({"prompt": "a cat"})  # a string alone: a constant, as before
    assert not is_raw_sample({"image": picture(0), "ids": torch.zeros(1, 3)})  # collated


@pytest.mark.parametrize("mode", ["1", "L", "I", "F", "RGB", "RGBA"])
@pytest.mark.parametrize("container", [None, list, tuple])
def test_images_come_back_with_their_pixels_size_and_mode(mode, container):
    frames = [picture(0, mode=mode), picture(1, mode=mode)]
    value = frames[0] if container is None else container(frames)
    spec = input_spec("video", value, 1, raw=True)
    assert (spec.kind, spec.value, spec.container) == ("images", mode, container)
    back = spec.decode(spec.encode(value))
    assert type(back) is (Image.Image if container is None else container)
    for original, copy in zip(
        [value] if container is None else value, [back] if container is None else back
    ):
        assert (copy.mode, copy.size, copy.tobytes()) == (
            original.mode,
            original.size,
            original.tobytes(),
        )


def test_the_default_path_caches_every_samples_frozen_calls_under_one_plan(tmp_path):
    step = RawSampleStep()
    data = samples(3)
    split = graphsplit.split(step, (data[0],))
    assert isinstance(split, graphsplit.CallSplit)
    assert split.input_names == ("image", "prompt")
    assert split.boundary["image"].shape == (1, 8, 8, 3)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith(("vae.", "text_encoder.")) for name in held)
    for sample in data[1:]:  # other pixels, other prompts of other lengths
        assert all(c.ok and c.max_abs_diff == 0 for c in graphsplit.verify(step, split, (sample,)))
    loader = DataLoader(data, collate_fn=lambda items: items[0])
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    rows = DataLoader(cached, batch_size=1, collate_fn=graphsplit.collate)
    for seed, (sample, batch) in enumerate(zip(data, rows, strict=True)):
        assert_same_step(
            lambda sample=sample: step(sample),
            lambda batch=batch: split.stage2(**batch),
            trainable(step),
            seed,
        )


def test_prompts_of_other_lengths_share_a_bucket_and_decode_exactly(tmp_path):
    """The prompt crosses as code points ``[1, len(prompt)]``, its width the prompt's own: the
    cache's buckets ignore it (a bucket per image shape, not per prompt length)."""
    step = RawSampleStep()
    prompts = ["a cat sits", "cat a a", "dog runs sits"]  # three words (ids), 10, 7, 13 characters
    data = [{"image": picture(seed), "prompt": prompt} for seed, prompt in enumerate(prompts)]
    split = graphsplit.split(step, (data[0],))
    assert split.boundary["prompt"].pad_dim == 1 and split.boundary["image"].pad_dim is None
    graphsplit.cache(split, DataLoader(data, collate_fn=lambda items: items[0]), tmp_path / "c")
    cached = graphsplit.CachedDataset(tmp_path / "c", split)
    assert len({cached.shapes(index)["prompt"] for index in range(3)}) == 3
    assert list(cached.buckets().values()) == [[0, 1, 2]]
    (spec,) = [spec for spec in split.plan.inputs if spec.name == "prompt"]
    for sample, batch in zip(data, cached.loader(batch_size=1, shuffle=False), strict=True):
        assert spec.decode(batch["prompt"]) == sample["prompt"]


def test_a_list_of_frames_crosses_as_one_sample():
    step = RawSampleStep()
    data = {"video": [picture(0), picture(1), picture(2)], "prompt": "a dog runs"}
    split = graphsplit.split(step, (data,))
    assert split.boundary["video"].shape == (1, 3, 8, 8, 3)
    other = {"video": [picture(3), picture(4), picture(5)], "prompt": "a cat"}
    assert_same_step(
        lambda: step(other), lambda: split.stage2(**split.stage1(**other)), trainable(step), 7
    )


def test_a_sample_of_another_image_size_is_refused_naming_the_field():
    step = RawSampleStep()
    split = graphsplit.split(step, (samples(1)[0],))
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(image=[picture(1, size=6)][0].convert("L"), prompt="a cat")
    message = str(caught.value)
    assert "the sample's 'image' holds images of mode L and sizes [(6, 6)]" in message
    assert "the plan was made with one size a sample and mode RGB" in message
    assert "fix:" in message and "resize and convert" in message


def test_a_prompt_that_is_not_a_string_is_refused():
    step = RawSampleStep()
    split = graphsplit.split(step, (samples(1)[0],))
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(image=picture(1), prompt=["a cat"])
    assert "the sample's 'prompt' is a list in this batch" in str(caught.value)


def test_decoding_refuses_a_batch_of_two_samples():
    two = torch.cat([encode_images("image", picture(0), "RGB")] * 2)
    with pytest.raises(graphsplit.SplitError) as caught:
        decode_images("image", two, "RGB", None)
    message = str(caught.value)
    assert "the step takes one raw sample per batch" in message and "holds 2" in message
    spec = input_spec("prompt", "a cat", 1, raw=True)
    with pytest.raises(graphsplit.SplitError, match="holds 2"):
        spec.decode(torch.cat([spec.encode("a cat")] * 2))


def test_stage1_given_the_dict_positionally_names_the_inputs_and_the_fix():
    step = RawSampleStep()
    sample = samples(1)[0]
    split = graphsplit.split(step, (sample,))
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(sample)
    message = str(caught.value)
    assert "stage 1 takes the step's inputs (image, prompt)" in message
    assert "split.stage1(**batch)" in message
