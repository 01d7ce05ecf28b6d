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
holding an int) are cached, and the split is exact. What is still missing is a cache of *many*
samples: the step's one input, ``data``, holds PIL frames and a string, which the plan keeps as
a constant of the example (nothing crosses the boundary for them), so another sample is refused.
"""

from __future__ import annotations

import sys

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
from graphsplit.errors import CacheError

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


def test_another_sample_is_refused_naming_the_input_the_plan_keeps_as_a_constant(wan):
    _, _, split = wan
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(wan_sample(1))
    message = str(caught.value)
    assert "the step's input 'data' is {'video': [<PIL.Image.Image" in message
    assert "(a non-tensor input is a constant of it)" in message
    assert "fix:" in message


@pytest.mark.xfail(
    strict=True,
    raises=CacheError,
    reason="cache() spreads the loader's dict into fields though the step takes it whole "
    "(forward(data)), and PIL frames / prompt strings cannot cross the boundary per sample",
)
def test_cache_over_diffsynths_loader_of_three_prompts(wan, tmp_path):
    _, _, split = wan
    loader = DataLoader(
        UnifiedLikeDataset([wan_sample(seed) for seed in range(3)]), collate_fn=lambda x: x[0]
    )
    graphsplit.cache(split, loader, tmp_path / "cache")
    assert len(graphsplit.CachedDataset(tmp_path / "cache")) == 3
