"""DiffSynth-Studio's ``WanTrainingModule.forward(data)``, unmodified, on DiffSynth's real data.

The batch is what DiffSynth's ``UnifiedDataset`` yields and its loader
(``collate_fn=lambda x: x[0]``) hands over: ``{"video": [PIL.Image, ...], "prompt": str}``.
The module's ``parse_extra_inputs`` / ``get_pipeline_inputs`` / ``forward`` are copied verbatim
from ``examples/wanvideo/model_training/train.py`` (``examples/diffsynth/real_data.py``); the
pipeline, units, models, tokenizer class (``HuggingfaceTokenizer`` on a tiny local word-level
tokenizer) and ``FlowMatchSFTLoss`` are DiffSynth 2.1.12's, tiny, random weights.

On the default path the whole-step trace refuses (the batch holds no tensor) and the
module-level path splits it: the text encoder (whose output the prompt unit writes in place,
``prompt_emb[:, v:] = 0``) and both VAE encoder calls (which return ``feat_idx``, a list
holding an int) are cached, and the split is exact. ``data`` is a raw sample
(:mod:`graphsplit.planning.step.raw_samples`): its frames cross the boundary as their pixels and
its prompt as its code points, so one plan serves every sample, ``graphsplit.cache`` takes
DiffSynth's own loader as it is, and training from the cache (one sample a batch, as DiffSynth
trains) is the unsplit step's, loss and every gradient bit for bit.
"""

from __future__ import annotations

import sys

import numpy
import pytest
import torch
from torch.utils.data import DataLoader

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    print(f"tests/conformance/test_unseen2_diffsynth.py skipped: {WHY_NOT}", file=sys.stderr)
    pytest.skip(WHY_NOT, allow_module_level=True)

import graphsplit
from examples.diffsynth.real_data import (
    UnifiedLikeDataset,
    wan_real_step,
    wan_sample,
    write_tiny_tokenizer,
)
from graphsplit.calls import Verdict
from tests.conformance.unseen2_data_checks import assert_same_step

pytestmark = pytest.mark.slow  # the split itself takes ~10 s on a shared CPU


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    step = wan_real_step(write_tiny_tokenizer(tmp_path_factory.mktemp("umt5-tiny")))
    data = wan_sample(0)
    return step, data, graphsplit.split(step, (data,))


def test_the_step_is_diffsynths_forward_on_pil_frames_and_a_prompt_string(wan):
    from diffsynth.models.wan_video_text_encoder import HuggingfaceTokenizer
    from diffsynth.pipelines.wan_video import WanVideoPipeline
    from PIL import Image

    step, data, _ = wan
    assert type(step.pipe) is WanVideoPipeline
    assert type(step.pipe.tokenizer) is HuggingfaceTokenizer
    assert all(isinstance(frame, Image.Image) for frame in data["video"])
    assert isinstance(data["prompt"], str)
    ids, mask = step.pipe.tokenizer(data["prompt"], return_mask=True, add_special_tokens=True)
    assert ids.shape == (1, 16) and int(mask.sum()) == len(data["prompt"].split())
    torch.manual_seed(0)
    loss = step(data)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_the_default_path_caches_the_text_encoder_and_the_vae_and_is_exact(wan):
    step, data, split = wan
    assert isinstance(split, graphsplit.CallSplit) and split.path == "calls"
    assert "the whole-step trace refused the step" in split.report()
    verdicts = {(v.path, v.index): v for v in split.plan.verdicts}
    assert verdicts[("pipe.text_encoder", 0)].verdict is Verdict.CACHED
    assert verdicts[("pipe.text_encoder", 0)].copied == ("out",)  # prompt_emb[:, v:] = 0
    assert verdicts[("pipe.vae.model.encoder", 0)].verdict is Verdict.CACHED
    assert verdicts[("pipe.vae.model.encoder", 1)].verdict is Verdict.CACHED
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith("pipe.text_encoder.") for name in held)
    assert not any(
        name.startswith(("pipe.vae.model.encoder.", "pipe.vae.model.conv1.")) for name in held
    )
    # Each encoder call returns (x, its causal convs' feature cache); the cache is read only by
    # the next encoder call, itself cached, so it is not stored (calls/usage.py): x alone is.
    encoder = [key for key in split.boundary if key.startswith("pipe_vae_model_encoder")]
    assert encoder == ["pipe_vae_model_encoder__0__0", "pipe_vae_model_encoder__1__0"]
    assert {key.rsplit("__", 1)[0] for key in split.plan.not_stored} == {
        "pipe_vae_model_encoder__0__1",
        "pipe_vae_model_encoder__1__1",
    }
    trainable = [name for name, p in step.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    comparisons = graphsplit.verify(step, split, (data,))
    assert all(c.ok and c.max_abs_diff == 0 for c in comparisons)
    assert {c.name for c in comparisons} >= {f"grad {name}" for name in trainable}


@pytest.mark.parametrize("seed", [1, 2])
def test_each_other_prompt_split_on_its_own_is_exact(wan, seed):
    step, _, _ = wan
    data = wan_sample(seed)  # another prompt (another length), other frames
    split = graphsplit.split(step, (data,))
    assert isinstance(split, graphsplit.CallSplit)
    assert all(c.ok and c.max_abs_diff == 0 for c in graphsplit.verify(step, split, (data,)))


def test_another_sample_crosses_the_boundary_and_trains_exactly(wan):
    step, _, split = wan
    data = wan_sample(1)  # another prompt (another length), other frames
    cached = split.stage1(**data)
    assert cached["prompt"].shape == (1, len(data["prompt"]))
    frames = numpy.stack([numpy.asarray(frame) for frame in data["video"]])
    assert torch.equal(cached["video"][0], torch.from_numpy(frames))
    trainable = [p for p in step.parameters() if p.requires_grad]
    assert_same_step(lambda: step(data), lambda: split.stage2(**cached), trainable, seed=3)


def test_a_palette_image_is_refused_naming_the_field_and_the_conversion(wan):
    _, _, split = wan
    data = wan_sample(1)
    data["video"] = [frame.convert("P") for frame in data["video"]]
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(**data)
    message = str(caught.value)
    assert "the sample's 'video' holds images of mode ['P']" in message
    assert "image.convert('RGB') for 'video'" in message


def test_cache_over_diffsynths_loader_trains_each_sample_exactly(wan, tmp_path):
    step, _, split = wan
    samples = [wan_sample(seed) for seed in range(3)]
    loader = DataLoader(UnifiedLikeDataset(samples), collate_fn=lambda x: x[0])
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert [cached[row]["key"] for row in range(len(cached))] == ["0", "1", "2"]
    trainable = [p for p in step.parameters() if p.requires_grad]
    rows = DataLoader(cached, batch_size=1, collate_fn=graphsplit.collate)
    for seed, (sample, batch) in enumerate(zip(samples, rows, strict=True)):
        assert_same_step(
            lambda sample=sample: step(sample),
            lambda batch=batch: split.stage2(**batch),
            trainable,
            seed,
        )


def test_two_samples_a_batch_are_refused_naming_the_fix(wan, tmp_path):
    _, _, split = wan
    loader = DataLoader(
        UnifiedLikeDataset([wan_sample(seed) for seed in range(2)]), collate_fn=lambda x: x[0]
    )
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    batch = graphsplit.collate([cached[0], cached[0]])
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage2(**batch)
    message = str(caught.value)
    assert "the step takes one raw sample per batch" in message
    assert "this batch holds 2" in message
    assert "DataLoader(dataset, batch_size=1)" in message


def test_recompute_auto_redoes_the_cross_attention_projections_exactly(wan):
    """By default the cache holds every block's frozen cross-attention key and value base
    projections of the text embedding; recompute="auto" redoes them (and the VAE's conv1) in
    stage 2 from what it reads anyway, priced as the whole-step trace prices a layer."""
    step, data, split = wan
    projections = [key for key in split.boundary if "cross_attn" in key]
    assert len(projections) == 4 and all("base_layer" in key for key in projections)
    assert "recompute='auto' would have stage 2 redo 5 cached frozen layer call(s)" in (
        split.report()
    )
    auto = graphsplit.split(step, (data,), recompute="auto")
    redone = [v.path for v in auto.plan.verdicts if v.verdict is Verdict.RECOMPUTED]
    assert sorted(redone) == [
        "pipe.dit.blocks.0.cross_attn.k.base_layer",
        "pipe.dit.blocks.0.cross_attn.v.base_layer",
        "pipe.dit.blocks.1.cross_attn.k.base_layer",
        "pipe.dit.blocks.1.cross_attn.v.base_layer",
        "pipe.vae.model.conv1",
    ]
    assert not [key for key in auto.boundary if "cross_attn" in key or "conv1" in key]
    per_sample = [sum(s.bytes_per_sample for s in x.boundary.values()) for x in (split, auto)]
    assert per_sample == [41068, 24684]
    assert all(c.ok for c in graphsplit.verify(step, auto, (wan_sample(1),), seed=0))
