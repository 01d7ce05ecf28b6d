"""Conformance: ``run_speech_recognition_seq2seq.py --freeze_encoder`` via ``split_trainer``.

Upstream: transformers' ``examples/pytorch/speech-recognition/run_speech_recognition_seq2seq.py``.
The script builds a Whisper model, and with ``--freeze_encoder``::

    model.freeze_encoder()
    model.model.encoder.gradient_checkpointing = False

(``--apply_spec_augment`` sets ``config.apply_spec_augment``), maps the audio through the
feature extractor (``input_features``, a log-mel spectrogram padded to the extractor's chunk)
and the transcripts through the tokenizer (``labels``), pads each batch with the script's
``DataCollatorSpeechSeq2SeqWithPadding`` (copied below: ``feature_extractor.pad`` on the
features, ``tokenizer.pad`` on the labels, padding -> -100, a leading decoder start token cut)
and trains with ``Seq2SeqTrainer`` (its ``compute_loss`` is ``Trainer``'s: ``model(**inputs)``,
the loss Whisper computes from ``labels``, shifting them into ``decoder_input_ids``).

Here the model is a tiny ``WhisperForConditionalGeneration`` (random weights), the processor a
real ``WhisperProcessor`` of a ``WhisperFeatureExtractor`` (16 mel bins, 1 s chunks: 100 frames)
and a word-level tokenizer, the audio random noise of 0.3 to 0.9 s. ``split_trainer`` splits the
trainer's ``compute_loss`` and trains stage 2 from the cache with ``trainer.train()``; the
collator pads the labels to the batch's longest, so the batches are the padding groups, given
to the plain trainer too with ``batch_by_padded_length``.

- ``frozen encoder``: the encoder's output is cached (stage 2 holds no encoder weight); two
  optimizer steps log the plain trainer's losses and gradient norms (``==``) and end with its
  weights bit for bit; ``compute_loss`` verifies on batches of 2 and 3 and a cache through the
  disk trains stage 2 exactly.
- ``spec augment`` (``apply_spec_augment=True``, ``mask_time_prob=0.2``): Whisper's
  ``_mask_input_features`` zeroes random time spans of ``input_features`` *in place*, drawn
  with NumPy (``_compute_mask_indices``), before the frozen encoder: a new mask every step, so
  nothing of the encoder may be cached. The whole-step trace refuses the NumPy draw and the
  module-level path caches only the position embeddings, which read no feature; the stored
  ``input_features`` are those the batch gave, not stage 1's masked ones, and the trainer
  trains as the plain one.

Tiny config: Whisper 32 wide, 2 encoder and 2 decoder layers, 2 heads, 50 audio positions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable, param_names

transformers = pytest.importorskip("transformers")
from graphsplit.integrations.transformers import (  # noqa: E402
    TrainerLoss,
    batch_by_padded_length,
    split_trainer,
)

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]
LENGTHS = [3, 3, 5, 5, 4, 4, 6, 6]  # transcript lengths: two per padded length


# -- upstream: run_speech_recognition_seq2seq.py's collator ------------------------------------
@dataclass
class DataCollatorSpeechSeq2SeqWithPadding:
    """
    Data collator that will dynamically pad the inputs received.
    Args:
        processor ([`WhisperProcessor`])
            The processor used for processing the data.
        decoder_start_token_id (`int`)
            The begin-of-sentence of the decoder.
        forward_attention_mask (`bool`)
            Whether to return attention_mask.
    """

    processor: Any
    decoder_start_token_id: int
    forward_attention_mask: bool

    def __call__(self, features):
        # split inputs and labels since they have to be of different lengths and need
        # different padding methods
        model_input_name = self.processor.model_input_names[0]
        input_features = [{model_input_name: feature[model_input_name]} for feature in features]
        label_features = [{"input_ids": feature["labels"]} for feature in features]

        batch = self.processor.feature_extractor.pad(input_features, return_tensors="pt")

        if self.forward_attention_mask:
            batch["attention_mask"] = torch.LongTensor(
                [feature["attention_mask"] for feature in features]
            )

        labels_batch = self.processor.tokenizer.pad(label_features, return_tensors="pt")

        # replace padding with -100 to ignore loss correctly
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)

        # if bos token is appended in previous tokenization step,
        # cut bos token here as it's append later anyways
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]

        batch["labels"] = labels

        return batch


# -- tiny model, processor and data --------------------------------------------------------------
@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOKENIZER = word_tokenizer(WORDS)
FEATURE_EXTRACTOR = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1)
PROCESSOR = transformers.WhisperProcessor(feature_extractor=FEATURE_EXTRACTOR, tokenizer=TOKENIZER)


def _dataset() -> list[dict]:
    """The script's ``prepare_dataset``: features of the audio, token ids of the transcript."""
    rng, noise = random.Random(0), np.random.default_rng(0)
    rows = []
    for length in LENGTHS:
        audio = noise.standard_normal(int(16000 * rng.uniform(0.3, 0.9))).astype(np.float32)
        inputs = FEATURE_EXTRACTOR(audio, sampling_rate=16000)
        text = " ".join(rng.choice(WORDS) for _ in range(length))
        rows.append(
            {"input_features": inputs.input_features[0], "labels": TOKENIZER(text).input_ids}
        )
    return rows


def _model(**config: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(
            vocab_size=len(TOKENIZER),
            num_mel_bins=16,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=50,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=2,
            decoder_start_token_id=2,
            **config,
        )
    )
    # --freeze_encoder
    model.freeze_encoder()
    model.model.encoder.gradient_checkpointing = False
    return model


def _collator(model: Any) -> DataCollatorSpeechSeq2SeqWithPadding:
    return DataCollatorSpeechSeq2SeqWithPadding(
        processor=PROCESSOR,
        decoder_start_token_id=model.config.decoder_start_token_id,
        forward_attention_mask=False,
    )


def _trainer(output_dir: str, **config: Any) -> Any:
    model = _model(**config)
    training_args = transformers.Seq2SeqTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        seed=42,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    return transformers.Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=_dataset(),
        processing_class=FEATURE_EXTRACTOR,
        data_collator=_collator(model),
    )


def _logged(trainer: Any) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _train_both(tmp_path, **config):
    plain = _trainer(str(tmp_path / "plain"), **config)
    assert batch_by_padded_length(plain) is not None  # the split run's batches
    plain.train()
    trainer = _trainer(str(tmp_path / "split"), **config)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    return plain, trainer, parts


def _same_weights(one: Any, other: Any) -> bool:
    a, b = one.model.state_dict(), other.model.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- tests ---------------------------------------------------------------------------------------
def test_the_frozen_encoder_is_cached_and_the_trainer_trains_as_plain(tmp_path):
    plain, trainer, parts = _train_both(tmp_path)
    assert len(_logged(trainer)) == 2
    assert _logged(trainer) == _logged(plain)
    assert _same_weights(trainer, plain)

    split = parts.split
    encoder = param_names(trainer.model.model.encoder, trainer.model)
    assert not param_names(split.stage2, split._model) & {f"model.{n}" for n in encoder}
    cached = [key for key in split.boundary if "encoder" in key]
    assert cached and split.boundary[cached[0]].shape[1:] == (50, 32), cached
    assert "input_features" not in split.boundary  # the spectrogram is not stored
    assert_stage1_holds_no_trainable(split)
    assert len(parts.cached) == len(LENGTHS)


def test_compute_loss_verifies_on_two_batch_sizes_and_round_trips(tmp_path):
    trainer = _trainer(str(tmp_path / "out"))
    loss = TrainerLoss(trainer)
    data, collate = _dataset(), _collator(trainer.model)
    example = dict(collate([data[0], data[1]]))
    split = graphsplit.split(loss, (example,))
    for batch in (example, dict(collate([data[2], data[3], data[6]]))):  # 2, then 3 samples
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)
    assert "model" in stage2_top_modules(split)
    loader = [dict(collate(data[i : i + 2])) for i in range(0, len(data), 2)]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)


def test_spec_augment_before_the_frozen_encoder_is_not_cached(tmp_path):
    """Whisper's SpecAugment zeroes NumPy-drawn spans of ``input_features`` in place before
    the frozen encoder: nothing it computes from them may be cached per sample. The probes used
    to run on the example's own tensors, so each added its mask to the example and both probes
    fed the encoder the same union of masks: its convolutions were cached with one draw frozen
    in (graphsplit/calls/analysis.py now starts each probe from the example as given). The
    position embeddings, which read no feature, are still cached, once."""
    config = {"apply_spec_augment": True, "mask_time_prob": 0.2, "mask_time_length": 5}
    trainer = _trainer(str(tmp_path / "out"), **config)
    loss = TrainerLoss(trainer)
    data, collate = _dataset(), _collator(trainer.model)
    example = dict(collate([data[0], data[1]]))
    features = example["input_features"].clone()
    split = graphsplit.split(loss, (example,))
    assert torch.equal(example["input_features"], features)  # the user's batch is left as given
    per_sample = {key for key, spec in split.boundary.items() if spec.batch_dim is not None}
    assert not [key for key in per_sample if "encoder" in key], split.boundary


def test_spec_augment_trains_as_the_plain_trainer(tmp_path):
    """Stage 1 ran the step up to the encoder's cached position embeddings, and SpecAugment
    masked the batch's ``input_features`` in place on the way: the cache stored the masked
    features, and stage 2 masked them again (a loss off in the 5th digit). Stage 1 now stores
    a copy of an input the step writes (``CallPlan.written_inputs``)."""
    config = {"apply_spec_augment": True, "mask_time_prob": 0.2, "mask_time_length": 5}
    plain, trainer, _parts = _train_both(tmp_path, **config)
    assert _logged(trainer) == _logged(plain)
    assert _same_weights(trainer, plain)
