"""Conformance: ``run_audio_classification.py`` with ``--freeze_feature_encoder``.

transformers' ``examples/pytorch/audio-classification/run_audio_classification.py`` builds
``AutoModelForAudioClassification`` (here ``Wav2Vec2ForSequenceClassification``), calls
``model.freeze_feature_encoder()`` and trains with the Trainer (``model(**batch).loss``). In
training mode the model draws SpecAugment's time masks with numpy inside ``forward``
(``_compute_mask_indices``, ``mask_time_prob``) after the feature projection, which trains. The
frozen convolutional feature encoder's output is what may be cached; the masks are drawn in
stage 2 in the step's order. Tiny config, random weights, batches of 1, 2 and 3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import graphsplit

transformers = pytest.importorskip("transformers")


class AudioClassification(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.Wav2Vec2Config(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=20,
            conv_dim=(8, 8),
            conv_stride=(4, 4),
            conv_kernel=(8, 8),
            num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2,
            mask_time_prob=0.5,  # the default 0.05 rarely masks a tiny clip: make it draw
            mask_time_length=2,
            layerdrop=0.0,
            num_labels=3,
            classifier_proj_size=8,
        )
        self.model = transformers.Wav2Vec2ForSequenceClassification(config).train()
        self.model.freeze_feature_encoder()

    def forward(self, input_values, labels):
        return self.model(input_values=input_values, labels=labels).loss


def _batch(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 400, generator=generator), torch.arange(size) % 3


def _loss_and_grads(run, params, seed: int):
    for param in params:
        param.grad = None
    torch.manual_seed(seed)
    np.random.seed(seed)
    loss = run()
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in params]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_audio_classification_caches_the_frozen_feature_encoder(size):
    torch.manual_seed(0)
    step = AudioClassification()
    batch = _batch(size)
    split = graphsplit.split(step, batch)
    assert all(c.ok for c in graphsplit.verify(step, split, batch, seed=size))
    # numpy draws inside the model's forward refuse the whole-step trace; the module-level
    # path caches the frozen feature encoder's call, fed the raw audio.
    assert isinstance(split, graphsplit.CallSplit)
    cached = {key for key in split.boundary if key not in split.input_names}
    assert cached == {"model_wav2vec2_feature_extractor__0__out"}
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".feature_extractor." in name for name in held)
    assert "model.wav2vec2.masked_spec_embed" in held
    # Trained from the cache after an optimizer step, under numpy and torch seeds of its own.
    boundary = split.stage1(*batch)
    params = [param for param in step.parameters() if param.requires_grad]
    with torch.no_grad():
        for param in params:
            param.add_(0.05)
    want, want_grads = _loss_and_grads(lambda: step(*batch), params, 7)
    got, got_grads = _loss_and_grads(lambda: split.stage2(**boundary), params, 7)
    assert torch.equal(want, got)
    assert all(torch.equal(a, b) for a, b in zip(want_grads, got_grads, strict=True))
