"""Conformance: ``run_speech_recognition_ctc.py``'s step, Wav2Vec2ForCTC with its feature encoder
frozen, as the script and the Trainer set it up and run it.

transformers' ``examples/pytorch/speech-recognition/run_speech_recognition_ctc.py`` builds a
character vocabulary from the transcripts (``create_vocabulary_from_data``: ``" "`` becomes the
word delimiter ``"|"``, ``[UNK]`` and ``[PAD]`` appended), a ``Wav2Vec2CTCTokenizer`` on it, a
``Wav2Vec2Processor``, updates the model's config with the script's defaults
(``mask_time_prob=0.05``, ``mask_time_length=10``, every dropout 0, ``layerdrop=0.0``,
``ctc_loss_reduction="mean"``, ``pad_token_id`` and ``vocab_size`` from the tokenizer), calls
``model.freeze_feature_encoder()`` (``--freeze_feature_encoder``, the default) and trains with
the Trainer through its ``DataCollatorCTCWithPadding`` (copied below: audio padded to the
batch's longest with an ``attention_mask``, labels padded apart and masked with -100).

The Trainer runs, per batch: ``num_items_in_batch`` counted from the labels
(``Trainer._get_num_items_in_batch``; Wav2Vec2ForCTC's ``forward`` takes ``**kwargs``, so the
Trainer passes it on), then ``compute_loss``: ``outputs = model(**inputs)``, ``loss =
outputs["loss"] if isinstance(outputs, dict) else outputs[0]``. In train mode the model draws
SpecAugment's time masks with numpy inside ``forward``, after the trainable feature
projection; the README's recipes add ``--gradient_checkpointing`` (the Trainer calls
``model.activation_checkpointing_enable()``, transformers 5's name), tested both ways.

What must hold: the step splits on the default path, exactly (loss and every trainable
gradient bit for bit, on the example and on a batch of another size and padding); the frozen
convolutional feature encoder's output is cached and its weights are not held by stage 2; a
cache of the script's loader written through the disk trains stage 2 exactly.

Tiny config in the style of ``wav2vec2-large-xlsr-53`` (layer-norm feature encoder, stable
layer norm, a feature extractor that returns an attention mask), random weights.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import graphsplit
from tests.conformance.unseen2_checks import cached_outputs, unstored_inputs
from tests.conformance.unseen2_data_checks import assert_same_step
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

TRANSCRIPTS = ["a cab", "bad dog", "go", "a big cod", "dab", "cog bag", "ego", "bog"]


def create_vocabulary_from_data(texts, word_delimiter_token=None, unk_token=None, pad_token=None):
    """The script's ``create_vocabulary_from_data``, over a list instead of a ``DatasetDict``."""
    vocab_set = functools.reduce(lambda a, b: a | b, (set(text) for text in texts))
    vocab_dict = {v: k for k, v in enumerate(sorted(list(vocab_set)))}

    # replace white space with delimiter token
    if word_delimiter_token is not None:
        vocab_dict[word_delimiter_token] = vocab_dict[" "]
        del vocab_dict[" "]

    # add unk and pad token
    if unk_token is not None:
        vocab_dict[unk_token] = len(vocab_dict)

    if pad_token is not None:
        vocab_dict[pad_token] = len(vocab_dict)

    return vocab_dict


@dataclass
class DataCollatorCTCWithPadding:
    """The script's collator (transformers 4.4x and later), verbatim."""

    processor: object
    padding: bool | str = "longest"
    pad_to_multiple_of: int | None = None
    pad_to_multiple_of_labels: int | None = None
    feature_extractor_input_name: str = "input_values"

    def __call__(self, features):
        # split inputs and labels since they have to be of different lengths and need
        # different padding methods
        input_features = [
            {self.feature_extractor_input_name: feature[self.feature_extractor_input_name]}
            for feature in features
        ]
        label_features = [{"input_ids": feature["labels"]} for feature in features]

        batch = self.processor.pad(
            input_features,
            padding=self.padding,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )

        labels_batch = self.processor.pad(
            labels=label_features,
            padding=self.padding,
            pad_to_multiple_of=self.pad_to_multiple_of_labels,
            return_tensors="pt",
        )

        # replace padding with -100 to ignore loss correctly
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)

        batch["labels"] = labels
        if "attention_mask" in batch:
            batch["attention_mask"] = batch["attention_mask"].to(torch.long)

        return batch


def _processor(folder):
    texts = [text + " " for text in TRANSCRIPTS]  # remove_special_characters appends " "
    vocab = create_vocabulary_from_data(texts, "|", "[UNK]", "[PAD]")
    vocab_file = folder / "vocab.json"
    vocab_file.write_text(json.dumps(vocab))
    tokenizer = transformers.Wav2Vec2CTCTokenizer(
        str(vocab_file), unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|"
    )
    feature_extractor = transformers.Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=16000,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=True,
    )
    return transformers.Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)


def _model(tokenizer, gradient_checkpointing: bool):
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
    )
    # adapt config (the script's defaults)
    config.update(
        {
            "feat_proj_dropout": 0.0,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "final_dropout": 0.0,
            "mask_time_prob": 0.05,
            "mask_time_length": 10,
            "mask_feature_prob": 0.0,
            "mask_feature_length": 10,
            "gradient_checkpointing": gradient_checkpointing,
            "layerdrop": 0.0,
            "ctc_loss_reduction": "mean",
            "pad_token_id": tokenizer.pad_token_id,
            "vocab_size": len(tokenizer),
            "activation_dropout": 0.0,
        }
    )
    model = transformers.Wav2Vec2ForCTC(config)
    # freeze encoder
    model.freeze_feature_encoder()
    if gradient_checkpointing:  # Trainer.__init__ with --gradient_checkpointing (v5's name)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=None)
    model.train()  # Trainer.train: model.train()
    return model


def _dataset(processor, count: int, seed: int = 0) -> list[dict]:
    """``prepare_dataset``: raw 16 kHz clips of 0.25 to 0.55 s, normalised; labels tokenised."""
    generator = np.random.default_rng(seed)
    rows = []
    for index in range(count):
        audio = 0.1 * generator.standard_normal(4000 + 1600 * (index % 3)).astype(np.float32)
        inputs = processor.feature_extractor(audio, sampling_rate=16000)
        text = TRANSCRIPTS[(index + seed) % len(TRANSCRIPTS)] + " "
        rows.append(
            {
                "input_values": inputs.input_values[0],
                "input_length": len(inputs.input_values[0]),
                "labels": processor.tokenizer(text).input_ids,
            }
        )
    return rows


class Script:
    """The script's objects and the Trainer's step over them."""

    def __init__(self, folder, gradient_checkpointing: bool) -> None:
        self.processor = _processor(folder)
        self.model = _model(self.processor.tokenizer, gradient_checkpointing)
        self.collator = DataCollatorCTCWithPadding(processor=self.processor)
        self.params = [
            p
            for n, p in self.model.named_parameters()
            if p.requires_grad and "masked_spec_embed" not in n  # no gradient without a mask
        ]
        model = self.model

        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            """``Trainer.compute_loss`` with no label smoother and no ``compute_loss_func``."""
            labels = None
            model_accepts_loss_kwargs = True  # Wav2Vec2ForCTC.forward takes **kwargs
            if model_accepts_loss_kwargs:
                kwargs = {}
                if num_items_in_batch is not None:
                    kwargs["num_items_in_batch"] = num_items_in_batch
                inputs = {**inputs, **kwargs}
            outputs = model(**inputs)
            if labels is None:
                if isinstance(outputs, dict) and "loss" not in outputs:
                    raise ValueError("The model did not return a loss from the inputs")
                # We don't use .loss here since the model may return tuples instead of ModelOutput.
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return (loss, outputs) if return_outputs else loss

        def training_step(inputs):
            # Trainer._get_num_items_in_batch (Wav2Vec2's CTC loss does not shift its labels)
            num_items_in_batch = inputs["labels"].ne(-100).sum()
            return compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

        self.step = training_step

    def loader(self, count: int, batch_size: int, seed: int = 0) -> DataLoader:
        dataset = _dataset(self.processor, count, seed)
        return DataLoader(dataset, batch_size=batch_size, collate_fn=self.collator)


_BUILT: dict[bool, tuple] = {}


def _built(gradient_checkpointing: bool, tmp_path_factory) -> tuple:
    if gradient_checkpointing not in _BUILT:
        folder = tmp_path_factory.mktemp("vocab")
        script = Script(folder, gradient_checkpointing)
        example = next(iter(script.loader(2, batch_size=2)))
        split = graphsplit.split(script.step, (example,))
        _BUILT[gradient_checkpointing] = (script, example, split)
    return _BUILT[gradient_checkpointing]


GC = [False, True]


@pytest.mark.parametrize("gradient_checkpointing", GC, ids=["plain", "grad-ckpt"])
def test_ctc_step_verifies_on_the_example_and_another_size(
    gradient_checkpointing, tmp_path_factory
):
    script, example, split = _built(gradient_checkpointing, tmp_path_factory)
    # The collator's batch: audio padded to the longest, its mask, labels padded with -100.
    assert isinstance(example, transformers.BatchFeature)
    assert example["input_values"].shape == (2, 5600)
    assert example["attention_mask"].dtype == torch.long and (example["attention_mask"] == 0).any()
    assert (example["labels"] == -100).any()
    assert_stage1_holds_no_trainable(split)
    other = next(iter(script.loader(3, batch_size=3, seed=1)))
    assert other["input_values"].shape == (3, 7200)
    for seed, batch in enumerate([example, other]):
        checks = graphsplit.verify(script.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("gradient_checkpointing", GC, ids=["plain", "grad-ckpt"])
def test_ctc_caches_the_frozen_feature_encoder(gradient_checkpointing, tmp_path_factory):
    script, _example, split = _built(gradient_checkpointing, tmp_path_factory)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".feature_extractor." in name for name in held), sorted(held)
    trainable = {name for name, p in split.stage2.named_parameters() if p.requires_grad}
    want = {n for n, p in script.model.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == want
    # The whole-step trace refuses (the model checks ``labels.max()`` and draws its masks with
    # numpy); the module-level path caches the conv encoder's call (16 channels at 1/20 of the
    # audio's rate) and stores no audio: stage 2 reads only its shape, the attention mask (the
    # feature mask and the CTC input lengths) and the labels.
    assert isinstance(split, graphsplit.CallSplit) and split.path == "calls"
    assert "labels.max() >= self.config.vocab_size" in split.reason
    assert cached_outputs(split) == {"model_wav2vec2_feature_extractor__0__out"}
    assert split.boundary["model_wav2vec2_feature_extractor__0__out"].shape[1:] == (16, 279)
    assert unstored_inputs(split) == {"input_values"}
    assert set(split.boundary) == {
        "input_values__shape",
        "attention_mask",
        "labels",
        "model_wav2vec2_feature_extractor__0__out",
    }


@pytest.mark.parametrize("gradient_checkpointing", GC, ids=["plain", "grad-ckpt"])
def test_ctc_cache_round_trip(gradient_checkpointing, tmp_path_factory, tmp_path):
    script, _example, split = _built(gradient_checkpointing, tmp_path_factory)
    """The script's loader cached as it is, read back, every sample once and in order; stage 2
    on each batch's rows trains as the step on the raw batch. The Trainer's ``set_seed`` seeds
    numpy with torch, so both runs draw the same SpecAugment masks."""
    loader = script.loader(5, batch_size=2, seed=2)  # batches of 2, 2 and 1, three paddings
    raw_batches = list(loader)
    assert [b["input_values"].shape[1] for b in raw_batches] == [5600, 7200, 5600]
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(cached) == 5
    assert [cached[row]["key"] for row in range(5)] == [str(row) for row in range(5)]
    row = 0
    for seed, raw in enumerate(raw_batches):
        size = len(raw["labels"])
        rows = graphsplit.collate([cached[row + offset] for offset in range(size)])
        row += size
        assert_same_step(
            lambda raw=raw: _numpy_seeded(script.step, raw),
            lambda rows=rows: _numpy_seeded(lambda b: split.stage2(**b), rows),
            script.params,
            seed,
        )


def _numpy_seeded(run, batch):
    np.random.seed(torch.initial_seed())  # transformers.set_seed seeds both
    return run(batch)
