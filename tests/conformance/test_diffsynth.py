"""DiffSynth-Studio's own training steps, unmodified, against graphsplit (issue 11 item 7).

The steps (``examples/diffsynth/steps.py``) are DiffSynth's ``WanTrainingModule.forward`` on
DiffSynth's pipeline, units, ``FlowMatchSFTLoss`` and model classes, tiny, random weights, one
sample per batch (DiffSynth's ``collate_fn=lambda x: x[0]``). Needs ``diffsynth==2.1.12``
(``pip install --no-deps diffsynth==2.1.12 einops ftfy sentencepiece imageio modelscope
pandas``); where it cannot import, the module is skipped with the reason printed.

What stops each step on this version, in the order it is hit (each found by rewriting the one
before it in a scratch copy, never in the tested code):

Wan 2.1 text-to-video LoRA (tiny, real weights: split + verify), unmodified:
  1. ``prompt_emb[:, v:] = 0`` in a loop over ``seq_lens`` (wan_video.py, PromptEmbedder) is
     frozen value-dependent code: ``WanVideoUnit_PromptEmbedder.encode_prompt`` runs as one
     opaque stage-1 step (issue 11 item 2), eagerly on the real batch.
  2. ``self.sigmas[timestep_id]`` (a 0-dim tensor index), ``rearrange`` on traced values and
     ``dit.freqs[0][:f]`` (a traced slice bound) are traced (issue 11 item 1).
  It splits, one sample per batch, and verifies bit for bit.

FLUX.1 LoRA at DiffSynth's full widths, built on meta (planned, not run): the guidance unit's
``torch.Tensor([embedded_guidance] * latents.shape[0])`` (flux_image.py) is one traced node
(issue 11 item 1), and it plans one sample per batch. The same step on real weights, made small
by block-list prefixes, splits and verifies in ``test_diffsynth_image.py``, with Qwen-Image.
"""

from __future__ import annotations

import sys

import pytest
import torch

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    print(f"tests/conformance/test_diffsynth.py skipped: {WHY_NOT}", file=sys.stderr)
    pytest.skip(WHY_NOT, allow_module_level=True)

import graphsplit
from examples.diffsynth.steps import wan_batch, wan_t2v_lora_step
from graphsplit.planning.rules.opaque_call import OPAQUE, is_opaque
from tests.helpers import line_of, split_and_verify

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wan():
    return wan_t2v_lora_step(seed=0)


def test_the_wan_step_is_diffsynths_own_and_trains_at_batch_one(wan):
    step, batch = wan
    from diffsynth.pipelines.wan_video import WanVideoPipeline, model_fn_wan_video

    assert type(step.pipe) is WanVideoPipeline
    assert step.pipe.model_fn is model_fn_wan_video
    trainable = [name for name, p in step.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and name.startswith("pipe.dit.") for name in trainable)
    torch.manual_seed(0)
    loss = step(**batch)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(step.get_parameter(name).grad is not None for name in trainable)
    step.zero_grad(set_to_none=True)


def test_wan_runs_the_per_sample_prompt_loop_as_one_opaque_stage1_step(wan):
    from diffsynth.pipelines.wan_video import WanVideoUnit_PromptEmbedder

    step, batch = wan
    split = graphsplit.split(step, kwargs=batch)
    (node,) = [node for node in split.graph.nodes if is_opaque(node)]
    assert node.meta[OPAQUE].label == "WanVideoUnit_PromptEmbedder.encode_prompt"
    read_at = node.meta[OPAQUE].read_at
    assert line_of(WanVideoUnit_PromptEmbedder.encode_prompt, "prompt_emb[:, v:] = 0") in read_at
    assert node in split.cut.stage1 and node not in split.cut.stage2
    calls = [line for line in split.stage1.code.splitlines() if "encode_prompt(" in line]
    assert len(calls) == 1  # one readable line: stage 1 runs DiffSynth's own encode_prompt
    assert "encode_prompt" not in split.stage2.code
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith("pipe.text_encoder.") for name in held)


def test_wan_t2v_lora_splits_and_verifies_exactly_one_sample_per_batch(wan):
    step, batch = wan
    split = split_and_verify(step, (), batch)
    assert any(note.startswith("one sample per batch") for note in split.notes)
    boundary_sources = " ".join(spec.source for spec in split.boundary.values())
    assert "wan_video.py" in boundary_sources  # the VAE latents and the text embedding
    other = wan_batch(seed=1)  # another sample through the same plan
    torch.manual_seed(1)
    expected = step(**other)
    torch.manual_seed(1)
    assert torch.equal(split.stage2(**split.stage1(**other)), expected)
    with pytest.raises(graphsplit.SplitError, match="this plan runs one sample per batch"):
        split.stage1(**{name: torch.cat([value, value]) for name, value in batch.items()})


def test_flux_lora_plans_one_sample_per_batch_on_meta_weights():
    from examples.diffsynth.steps import flux_lora_step_on_meta

    step, batch = flux_lora_step_on_meta()
    split = graphsplit.split(step, kwargs=batch)
    assert any(note.startswith("one sample per batch") for note in split.notes)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith("pipe.text_encoder_2.") for name in held)  # no T5-XXL
    assert not any(name.startswith("pipe.vae_encoder.") for name in held)
    sources = " ".join(spec.source for spec in split.boundary.values())
    assert "flux_image.py" in sources
