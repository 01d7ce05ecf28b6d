"""Wav2Vec2ForCTC with a frozen feature encoder and a frozen teacher, on the module-level path.

In training mode ``Wav2Vec2ForCTC`` draws its SpecAugment masks with numpy inside ``forward``
and checks ``labels.max() >= vocab_size`` before its CTC loss: both stay in stage 2, run as
transformers wrote them. What the module path caches exactly: the frozen feature encoder's
call (made inside transformers' ``Wav2Vec2Model.forward``, fed the raw audio) and the frozen
teacher's call (eval mode, fed the audio). Tiny random config, batches of 1, 2 and 3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import graphsplit
from graphsplit.calls import Verdict


def config() -> transformers.Wav2Vec2Config:
    return transformers.Wav2Vec2Config(
        vocab_size=12,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
        conv_dim=(8, 8),
        conv_stride=(4, 4),
        conv_kernel=(8, 8),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.5,
        mask_time_length=2,
        layerdrop=0.0,
        ctc_loss_reduction="mean",
        pad_token_id=0,
    )


class DistillStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = transformers.Wav2Vec2ForCTC(config()).train()
        self.student.freeze_feature_encoder()
        self.teacher = transformers.Wav2Vec2ForCTC(config()).eval().requires_grad_(False)

    def forward(self, input_values, labels):
        with torch.no_grad():
            teacher_logits = self.teacher(input_values).logits
        out = self.student(input_values, labels=labels)
        distill = F.kl_div(
            out.logits.log_softmax(-1), teacher_logits.softmax(-1), reduction="batchmean"
        )
        return out.loss + distill


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    audio = torch.randn(size, 400, generator=generator)
    labels = torch.randint(1, 12, (size, 5), generator=generator)
    labels[0, 3:] = -100
    return audio, labels


def run(step_or_stages, args, seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    return step_or_stages(*args)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_wav2vec2_caches_the_feature_encoder_and_the_teacher_exactly(size):
    step = DistillStep()
    args = batch(size)
    split = graphsplit.split(step, args, path="calls")
    verdicts = {(v.path, v.index): v.verdict for v in split.plan.verdicts}
    assert verdicts == {
        ("teacher", 0): Verdict.CACHED,
        ("student.wav2vec2.feature_extractor", 0): Verdict.CACHED,
    }
    assert set(split.boundary) == {
        "input_values",
        "labels",
        "teacher__0__logits",
        "student_wav2vec2_feature_extractor__0__out",
    }
    held = [name for name, _ in split.stage2.named_parameters()]
    assert not any(n.startswith(("teacher.", "student.wav2vec2.feature_extractor.")) for n in held)
    assert "student.wav2vec2.masked_spec_embed" in held
    # Loss and gradients bit for bit; SpecAugment's numpy masks drawn in stage 2 as in the step.
    assert all(c.ok for c in graphsplit.verify(step, split, args, seed=size))
    cached = split.stage1(*args)
    expected = run(step, args, 5)
    assert torch.equal(run(lambda: split.stage2(**cached), (), 5), expected)


def test_the_value_check_still_speaks_in_stage_2():
    step = DistillStep()
    args = batch(2)
    split = graphsplit.split(step, args, path="calls")
    audio, labels = args
    bad = labels.clone()
    bad[1, 0] = 40  # beyond the vocabulary: transformers' own check runs in both stages
    with pytest.raises(ValueError, match="vocab_size"):
        split.stage1(audio, bad)  # stage 1 runs the student up to its feature encoder
    cached = split.stage1(audio, labels) | {"labels": bad}
    with pytest.raises(ValueError, match="vocab_size"):
        split.stage2(**cached)


def test_auto_falls_back_from_the_value_check_and_says_so():
    step = DistillStep()
    args = batch(2)
    split = graphsplit.split(step, args)
    assert isinstance(split, graphsplit.CallSplit)
    # The mixed student is traced into: the read is transformers' own label check, in a
    # function that runs the trainable model too (so it cannot run once in stage 1).
    assert split.reason.startswith("Wav2Vec2ForCTC.forward reads tensor values and reads the ")
    assert "labels.max() >= self.config.vocab_size" in split.reason
    assert "path: calls, because the whole-step trace refused the step" in split.report()
    assert all(c.ok for c in graphsplit.verify(step, split, args))
