"""A raw sample whose step calls a frozen module the example's never did: stage 1 refuses it.

DiffSynth-Studio's loader hands the step one dataset item as it is (``{"video": [PIL.Image,
...], "prompt": str, ...}``), and a dataset mixing variants (text-to-video samples beside
image-to-video ones, a ``task`` field choosing) takes a branch per sample. The module-level plan
is made from the example sample's calls: a frozen module that sample never called (here the
image encoder of the i2v branch, loaded and frozen beside the VAE) has no cached call, and stage
2 does not hold it. A later sample that takes the branch must be refused when stage 1 meets the
call -- naming the module, the user's line and the fix -- not cached into rows stage 2 cannot
train from (it would run the image encoder whose weights it does not hold).

The step is plain PyTorch in DiffSynth's data format: DiffSynth's own ``WanTrainingModule``
takes the same extra inputs for every sample of a run, so it has no such per-sample branch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import graphsplit

Image = pytest.importorskip("PIL.Image")


class MixedTaskStep(nn.Module):
    """A LoRA-like trainable head over a frozen VAE, and a frozen image encoder on i2v samples."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image_encoder = nn.Linear(3, 4).requires_grad_(False)
        self.vae = nn.Conv2d(3, 4, 2, stride=2).requires_grad_(False)
        self.dit = nn.Linear(4, 4)

    @staticmethod
    def pixels(image: object) -> torch.Tensor:
        array = np.array(image, dtype=np.float32) / 255
        return torch.from_numpy(array).permute(2, 0, 1)[None]

    def forward(self, data: dict) -> torch.Tensor:
        first = self.pixels(data["video"][0])
        clip = None
        if data["task"] == "i2v":
            clip = self.image_encoder(first.mean((2, 3)))  # the i2v branch's frozen call
        latents = self.vae(first)
        if clip is not None:
            latents = latents + clip[:, :, None, None]
        noise = torch.randn_like(latents)
        prediction = self.dit((latents + noise).permute(0, 2, 3, 1))
        return ((prediction - noise.permute(0, 2, 3, 1)) ** 2).mean()


def sample(seed: int, task: str) -> dict:
    rng = np.random.default_rng(seed)
    frame = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), mode="RGB")
    return {"video": [frame], "prompt": "a cat sits", "task": task}


@pytest.fixture(scope="module")
def planned():
    step = MixedTaskStep()
    split = graphsplit.split(step, (sample(0, "t2v"),))
    return step, split


def test_the_plan_caches_the_vae_and_does_not_hold_the_image_encoder(planned):
    _, split = planned
    assert isinstance(split, graphsplit.CallSplit)
    assert [(v.path, v.index) for v in split.plan.verdicts if v.cached] == [("vae", 0)]
    assert "image_encoder" in split.plan.unused
    assert not any(name.startswith("image_encoder.") for name, _ in split.stage2.named_parameters())


def test_a_sample_of_the_examples_variant_caches_and_trains_exactly(planned):
    step, split = planned
    data = sample(1, "t2v")
    batch = split.stage1(**data)
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = step(data)
        torch.manual_seed(seed)
        got = split.stage2(**batch)
        assert torch.equal(want, got)


def test_a_sample_calling_a_frozen_module_the_example_never_called_is_refused(planned):
    _, split = planned
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(**sample(1, "i2v"))
    message = str(caught.value)
    assert "frozen module 'image_encoder'" in message
    assert "the example batch's step never called it" in message
    assert "stage 2 does not hold it" in message
    assert "test_unseen4_diffsynth_unseen_calls.py" in message
    assert "clip = self.image_encoder(first.mean((2, 3)))" in message
    assert "split with an example batch that takes this sample's branch" in message


def test_caching_a_loader_with_such_a_sample_stops_at_it(planned, tmp_path):
    _, split = planned
    # DiffSynth's loader: one dataset item a batch, as it is (collate_fn=lambda x: x[0]).
    loader = torch.utils.data.DataLoader(
        [sample(1, "t2v"), sample(2, "i2v")], collate_fn=lambda x: x[0]
    )
    with pytest.raises(graphsplit.SplitError, match="frozen module 'image_encoder'"):
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)


def test_a_plan_made_on_the_branch_caches_the_image_encoder(planned):
    step, _ = planned
    data = sample(0, "i2v")
    split = graphsplit.split(step, (data,))
    cached = [(v.path, v.index) for v in split.plan.verdicts if v.cached]
    assert cached == [("image_encoder", 0), ("vae", 0)]
    comparisons = graphsplit.verify(step, split, (sample(3, "i2v"),))
    assert all(c.ok and c.max_abs_diff == 0 for c in comparisons)
