"""DiffSynth-Studio's ``WanTrainingModule`` for Wan variants beyond T2V, split on raw samples.

Each variant is train.py's module as its ``lora/*.sh`` runs it (see
:mod:`tests.conformance.unseen4_diffsynth_wan`): Wan 2.1 image-to-video (CLIP image encoder and
the VAE-encoded first frame), first-last-frame (both frames through both), Fun-Control (the
control video through the VAE), Wan 2.2 TI2V-5B (the 48-channel VAE, the first frame's
latents fused into the noisy latents) and VACE (control video and reference image, the LoRA
on ``vace``), tiny, random weights, on the sample DiffSynth's loader hands over: PIL frames
and a prompt string. The whole-step trace refuses the batch (it holds no tensor) and the
module-level path splits it; each variant's frozen encoders are cached and not held by stage
2, and two AdamW steps (train.py's optimizer) trained from the cache are the unsplit step's:
loss and every LoRA gradient bit for bit, the second on the weights the first moved.
"""

from __future__ import annotations

import sys

import pytest

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    print(
        f"tests/conformance/test_unseen4_diffsynth_wan_extra.py skipped: {WHY_NOT}", file=sys.stderr
    )
    pytest.skip(WHY_NOT, allow_module_level=True)

import graphsplit
from examples.diffsynth.real_data import write_tiny_tokenizer
from graphsplit.calls import Verdict
from tests.conformance.unseen4_diffsynth_wan import (
    assert_two_steps_exact,
    variant_sample,
    wan_variant_step,
)

pytestmark = pytest.mark.slow  # a split and four training steps per variant, ~10 s each

ENCODER = "pipe.vae.model.encoder"
VISUAL = "pipe.image_encoder.model.visual"

CACHED = {
    # The video (two encoder calls: 1 + 4 frames), then the first frame with zeros behind it.
    "i2v": {(ENCODER, 0), (ENCODER, 1), (ENCODER, 2), (ENCODER, 3), (VISUAL, 0)},
    # Both frames through CLIP (calls 0 and 1), the first and last frame through the VAE.
    "flf2v": {(ENCODER, 0), (ENCODER, 1), (ENCODER, 2), (ENCODER, 3), (VISUAL, 0), (VISUAL, 1)},
    # The video, then the control video; CLIP is loaded and never called.
    "fun_control": {(ENCODER, 0), (ENCODER, 1), (ENCODER, 2), (ENCODER, 3)},
    # The video, then the first frame alone (one encoder call).
    "ti2v": {(ENCODER, 0), (ENCODER, 1), (ENCODER, 2)},
    # The video with the reference frame before it, the control video's inactive and reactive
    # parts, the reference image: through the VAE; the control latents through vace's patches.
    "vace": {(ENCODER, i) for i in range(8)} | {("pipe.vace.vace_patch_embedding", 0)},
}
"""Each variant's frozen calls the split must cache, beside the text encoder's."""

NOT_HELD = {
    "i2v": ("pipe.text_encoder.", "pipe.vae.", "pipe.image_encoder."),
    "flf2v": ("pipe.text_encoder.", "pipe.vae.", "pipe.image_encoder."),
    "fun_control": ("pipe.text_encoder.", "pipe.vae.", "pipe.image_encoder."),
    "ti2v": ("pipe.text_encoder.", "pipe.vae."),
    "vace": ("pipe.text_encoder.", "pipe.vae.", "pipe.vace.vace_patch_embedding."),
}
"""The frozen models stage 2 must not hold a weight of."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("umt5-tiny"))


@pytest.mark.parametrize("variant", sorted(CACHED))
def test_the_variant_caches_its_encoders_and_trains_two_steps_exactly(
    variant, tokenizer_dir, tmp_path
):
    step = wan_variant_step(variant, tokenizer_dir)
    data = variant_sample(variant, 0)
    split = graphsplit.split(step, (data,))
    assert isinstance(split, graphsplit.CallSplit) and split.path == "calls"
    verdicts = {(v.path, v.index): v.verdict for v in split.plan.verdicts}
    for call in CACHED[variant] | {("pipe.text_encoder", 0)}:
        assert verdicts.get(call) is Verdict.CACHED, (call, verdicts.get(call))
    if variant == "fun_control":  # loaded as the script loads it, never called
        assert not any(path.startswith("pipe.image_encoder") for path, _ in verdicts)
        assert "pipe.image_encoder" in split.plan.unused
    held = [name for name, _ in split.stage2.named_parameters()]
    assert not [name for name in held if name.startswith(NOT_HELD[variant])]
    lora_on = "pipe.vace." if variant == "vace" else "pipe.dit."
    trainable = [name for name, p in step.named_parameters() if p.requires_grad]
    assert trainable and all(name.startswith(lora_on) and "lora_" in name for name in trainable)
    assert_two_steps_exact(step, split, data, tmp_path / "cache")
