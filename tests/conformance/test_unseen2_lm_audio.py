"""Conformance: transformers' speech scripts with a frozen encoder.

Whisper fine-tuning as ``run_speech_recognition_seq2seq.py --freeze_encoder`` sets it up (the
frozen encoder's states cached, the whole decoder trained, labels of two lengths through one
cache); and ``run_audio_classification.py`` with ``--freeze_feature_encoder``:

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
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.helpers import split_and_verify

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
    # Only the cached feature encoder computes with the waveform: its shape is stored, not it.
    assert cached == {"model_wav2vec2_feature_extractor__0__out", "input_values__shape"}
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


# --- run_speech_recognition_seq2seq.py --freeze_encoder --------------------------------------


class WhisperFineTuning(nn.Module):
    """``run_speech_recognition_seq2seq.py`` with ``--freeze_encoder``: ``model.freeze_encoder()``
    and ``model.model.encoder.gradient_checkpointing = False`` as the script sets them; the
    whole decoder trains; ``Seq2SeqTrainer`` calls ``model(**batch).loss``."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        config = transformers.WhisperConfig(
            vocab_size=vocab,
            num_mel_bins=8,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            d_model=16,
            max_source_positions=16,
            max_target_positions=32,
            pad_token_id=vocab - 1,
            decoder_start_token_id=vocab - 2,
            bos_token_id=vocab - 2,
            eos_token_id=vocab - 3,
        )
        self.model = transformers.WhisperForConditionalGeneration(config).train()
        self.model.freeze_encoder()
        self.model.model.encoder.gradient_checkpointing = False

    def forward(self, input_features, labels):
        return self.model(input_features=input_features, labels=labels).loss


def _speech_batch(size: int, tokens: int = 7, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``DataCollatorSpeechSeq2SeqWithPadding``: log-mel features, labels padded with -100
    (the leading decoder-start token already cut by the collator)."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, 8, 32, generator=generator)  # 2 * max_source_positions
    labels = torch.randint(0, 61, (size, tokens), generator=generator)
    labels[0, tokens - 2 :] = -100
    return features, labels


@pytest.mark.parametrize("size", [1, 2, 3])
def test_whisper_with_a_frozen_encoder_caches_its_states(size, tmp_path):
    torch.manual_seed(0)
    step = WhisperFineTuning()
    batch = _speech_batch(size)
    split = split_and_verify(step, batch)
    held = stage2_paths(split)
    assert "model.model.decoder" in held
    assert not {path for path in held if path.startswith("model.model.encoder")}
    cached = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert cached.pop("model_model_encoder_0") == (16, 16)  # the encoder's last hidden state
    assert set(cached) == {"labels"}
    other = _speech_batch(size, tokens=5, seed=1)  # other label lengths: a plan of its own
    assert_trains_from_its_cache(step, split, [batch, other], tmp_path / "cache")
