"""Conformance: audio batches as the speech scripts make them, feature extractors and padding.

``run_speech_recognition_seq2seq.py`` (``--freeze_encoder``) trains Whisper's decoder on log-mel
``input_features`` from ``WhisperFeatureExtractor`` (padded to its 30 s window, here 1 s), with
its ``DataCollatorSpeechSeq2SeqWithPadding``: labels padded with -100, the start token cut.
``run_speech_recognition_ctc.py`` trains Wav2Vec2 with ``freeze_feature_encoder()`` on raw
``input_values`` that ``Wav2Vec2FeatureExtractor`` normalises and pads to each batch's longest,
with an ``attention_mask``, through its ``DataCollatorCTCWithPadding``. Models from tiny
configs; each loader is cached, read back, and stage 2 trains on each batch's rows as the
unsplit step, loss and gradients bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip

transformers = pytest.importorskip("transformers")


def _clips(count: int, seed: int = 0) -> list[dict]:
    """Raw 16 kHz clips of 0.2 to 0.5 s and token transcripts of 2 to 5 tokens."""
    generator = torch.Generator().manual_seed(seed)
    clips = []
    for index in range(count):
        samples = 3200 + 1000 * (index % 4)
        tokens = 2 + index % 4
        clips.append(
            {
                "audio": (0.1 * torch.randn(samples, generator=generator)).numpy(),
                "tokens": torch.randint(3, 16, (tokens,), generator=generator).tolist(),
            }
        )
    return clips


# --- Whisper, encoder frozen ---------------------------------------------------------------------

feature_extractor = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1)


def _whisper():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=16,
        num_mel_bins=16,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=50,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = transformers.WhisperForConditionalGeneration(config)
    model.freeze_encoder()  # the script's --freeze_encoder
    return model


whisper = _whisper()
WHISPER_PARAMS = [p for p in whisper.parameters() if p.requires_grad]


def prepare_whisper(clip):  # the script's prepare_dataset
    features = feature_extractor(clip["audio"], sampling_rate=16000).input_features[0]
    return {"input_features": features, "labels": [1, *clip["tokens"], 2]}


class DataCollatorSpeechSeq2SeqWithPadding:  # the script's, with a tokenizer's pad done by hand
    decoder_start_token_id = 1

    def __call__(self, features):
        input_features = [{"input_features": f["input_features"]} for f in features]
        batch = feature_extractor.pad(input_features, return_tensors="pt")
        longest = max(len(f["labels"]) for f in features)
        labels = torch.tensor(
            [f["labels"] + [-100] * (longest - len(f["labels"])) for f in features]
        )
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        return batch


def whisper_step(batch):  # Seq2SeqTrainer's compute_loss: model(**inputs).loss
    return whisper(**batch).loss


def test_whisper_input_features_with_a_frozen_encoder(tmp_path):
    dataset = [prepare_whisper(clip) for clip in _clips(6)]
    loader = DataLoader(dataset, batch_size=4, collate_fn=DataCollatorSpeechSeq2SeqWithPadding())
    batches = list(loader)
    assert batches[0]["input_features"].shape == (4, 16, 100)
    assert [b["labels"].shape for b in batches] == [(4, 6), (2, 4)]
    split = graphsplit.split(whisper_step, (dict(batches[0]),))
    assert "input_features" not in split.boundary  # the frozen encoder's output is cached
    assert_cache_round_trip(
        split, lambda b: whisper_step(dict(b)), loader, tmp_path / "cache", WHISPER_PARAMS
    )


# --- Wav2Vec2 CTC, feature encoder frozen ------------------------------------------------------

wav2vec_extractor = transformers.Wav2Vec2FeatureExtractor(
    feature_size=1,
    sampling_rate=16000,
    padding_value=0.0,
    do_normalize=True,
    return_attention_mask=True,
)


def _wav2vec2():
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        mask_time_prob=0.0,
        layerdrop=0.0,  # the script's default
        pad_token_id=0,
        ctc_loss_reduction="mean",
    )
    model = transformers.Wav2Vec2ForCTC(config)
    model.freeze_feature_encoder()  # the script's default
    return model


wav2vec2 = _wav2vec2()
WAV2VEC2_PARAMS = [  # masked_spec_embed is unused without SpecAugment
    p for n, p in wav2vec2.named_parameters() if p.requires_grad and "masked_spec" not in n
]


class DataCollatorCTCWithPadding:  # the script's: pad audio and labels apart, -100 on labels
    def __call__(self, features):
        inputs = [{"input_values": f["input_values"]} for f in features]
        batch = wav2vec_extractor.pad(inputs, padding=True, return_tensors="pt")
        longest = max(len(f["labels"]) for f in features)
        batch["labels"] = torch.tensor(
            [f["labels"] + [-100] * (longest - len(f["labels"])) for f in features]
        )
        return batch


def prepare_wav2vec2(clip):
    values = wav2vec_extractor(clip["audio"], sampling_rate=16000).input_values[0]
    return {"input_values": values, "labels": clip["tokens"]}


def wav2vec2_step(batch):
    return wav2vec2(**batch).loss


def test_wav2vec2_input_values_padded_per_batch_with_an_attention_mask(tmp_path):
    dataset = [prepare_wav2vec2(clip) for clip in _clips(6)]
    loader = DataLoader(dataset, batch_size=2, collate_fn=DataCollatorCTCWithPadding())
    batches = list(loader)
    assert [b["input_values"].shape[1] for b in batches] == [4200, 6200, 4200]
    assert batches[0]["attention_mask"].dtype == torch.int32
    assert (batches[0]["attention_mask"] == 0).any()
    split = graphsplit.split(wav2vec2_step, (dict(batches[0]),))
    assert_cache_round_trip(
        split, lambda b: wav2vec2_step(dict(b)), loader, tmp_path / "cache", WAV2VEC2_PARAMS
    )
