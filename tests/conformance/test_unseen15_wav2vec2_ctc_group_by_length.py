"""Conformance: ``run_speech_recognition_ctc.py`` with ``group_by_length``: clips of 26
lengths, a frozen feature encoder, the whole loader cached and an epoch trained from the cache.

transformers' ``examples/pytorch/speech-recognition/run_speech_recognition_ctc.py`` maps the
raw audio through its ``prepare_dataset`` (copied verbatim: ``input_values``, ``input_length``
and the tokenized ``labels``), builds a character vocabulary (``create_vocabulary_from_data``),
updates the config with its defaults (``mask_time_prob=0.05``, every dropout 0,
``layerdrop=0.0``, ``ctc_loss_reduction="mean"``), calls ``model.freeze_feature_encoder()``
(``--freeze_feature_encoder``, the default) and trains with the ``Trainer`` through its
``DataCollatorCTCWithPadding`` (copied verbatim: audio padded to the batch's longest with an
``attention_mask``, labels padded apart and masked with -100). Its README recipes pass
``--group_by_length --length_column_name input_length`` (transformers 5:
``train_sampling_strategy="group_by_length"``): the ``Trainer``'s ``_get_train_sampler``
returns a ``LengthGroupedSampler`` over the ``input_length`` column, so every batch holds clips
of similar length. The caching pass reads the order it draws once (seeded), a last batch of 2.

The Trainer's step per batch: ``num_items_in_batch`` from the labels, then ``compute_loss``
(``outputs = model(**inputs)``, ``outputs["loss"]``); in train mode Wav2Vec2 draws SpecAugment's
time masks with numpy, seeded from torch as ``transformers.set_seed`` seeds both.

What must hold: the split (default path) verifies on the example and on the last, shorter
batch; the frozen convolutional feature encoder's output is cached and stage 2 holds none of
its weights; every sample of the cache equals stage 1 on its raw batch; stage 2 on each written
batch, and on every batch of an epoch of ``cached.loader(shuffle=False)`` (each bucket, one
padded length, is one raw batch), trains exactly as the step on those batches. A shuffled
``cached.loader`` gives each raw batch's rows in another order, and on some CPUs the step on
the samples in that order moves in the last bit (Wav2Vec2LayerNormConvLayer applies GELU to a
transposed view, whose last 16 floats AVX-512 computes apart), while each cached row is stage
1's own: docs/howto.md "Exact batches" says so; not asserted here, as it depends on the CPU.

Tiny config in the style of ``wav2vec2-large-xlsr-53`` (layer-norm feature encoder, stable
layer norm, an extractor that returns an attention mask), random weights.
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
from tests.conformance.unseen15_d_checks import cache_whole_loader, train_epoch_from_cache
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

TRANSCRIPTS = ["a cab", "bad dog", "go", "a big cod", "dab", "cog bag", "ego", "bog"]
# Twenty-six clip lengths (samples at 16 kHz, 0.2 to 0.73 s), no two alike. At 26 clips and
# batches of 3 the sampler's megabatches hold 6 clips (``26 // (3 * 4)`` batches), sorted by
# length: 9 batches, the last of 2, each at its own padded length.
CLIP_LENGTHS = [3200 + 340 * ((7 * index) % 26) for index in range(26)]
BATCH_SIZE = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: the module's fixtures (split, cache) run on one thread too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    """The script's collator, verbatim."""

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


class Script:
    """The script's objects: processor, model, vectorized dataset, collator, Trainer step."""

    def __init__(self, folder) -> None:
        texts = [text + " " for text in TRANSCRIPTS]  # remove_special_characters appends " "
        vocab_file = folder / "vocab.json"
        vocab_file.write_text(json.dumps(create_vocabulary_from_data(texts, "|", "[UNK]", "[PAD]")))
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
        self.processor = transformers.Wav2Vec2Processor(
            feature_extractor=feature_extractor, tokenizer=tokenizer
        )
        self.model = self._model(tokenizer)
        self.dataset = self._vectorized(feature_extractor, tokenizer)
        self.collator = DataCollatorCTCWithPadding(processor=self.processor)
        self.params = [
            p
            for n, p in self.model.named_parameters()
            if p.requires_grad and "masked_spec_embed" not in n  # no gradient without a mask
        ]
        self.trainer = transformers.Trainer(
            model=self.model,
            args=transformers.TrainingArguments(
                output_dir=str(folder / "out"),
                per_device_train_batch_size=BATCH_SIZE,
                train_sampling_strategy="group_by_length",  # --group_by_length
                length_column_name="input_length",
                report_to=[],
                use_cpu=True,
            ),
            data_collator=self.collator,
            train_dataset=self.dataset,
            processing_class=feature_extractor,
        )
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

    @staticmethod
    def _model(tokenizer):
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
                "gradient_checkpointing": False,
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
        model.train()  # Trainer.train: model.train()
        return model

    @staticmethod
    def _vectorized(feature_extractor, tokenizer):
        noise = np.random.default_rng(0)
        raw = datasets.Dataset.from_list(
            [
                {
                    "audio": {
                        "array": (0.1 * noise.standard_normal(length)).astype(np.float32),
                        "sampling_rate": 16000,
                    },
                    "target_text": TRANSCRIPTS[index % len(TRANSCRIPTS)] + " ",
                }
                for index, length in enumerate(CLIP_LENGTHS)
            ]
        )
        audio_column_name = "audio"
        phoneme_language = None

        # Preprocessing the datasets.
        # We need to read the audio files as arrays and tokenize the targets.
        def prepare_dataset(batch):
            # load audio
            sample = batch[audio_column_name]

            inputs = feature_extractor(sample["array"], sampling_rate=sample["sampling_rate"])
            batch["input_values"] = inputs.input_values[0]
            batch["input_length"] = len(batch["input_values"])

            # encode targets
            additional_kwargs = {}
            if phoneme_language is not None:
                additional_kwargs["phonemizer_lang"] = phoneme_language

            batch["labels"] = tokenizer(batch["target_text"], **additional_kwargs).input_ids
            return batch

        return raw.map(prepare_dataset, remove_columns=raw.column_names)

    def loader(self) -> DataLoader:
        """The Trainer's group-by-length order, drawn once (seeded), in the Trainer's batches."""
        torch.manual_seed(0)
        order = list(self.trainer._get_train_sampler())
        return DataLoader(
            self.dataset, batch_size=BATCH_SIZE, sampler=order, collate_fn=self.collator
        )


def _numpy_seeded(run):
    np.random.seed(torch.initial_seed())  # transformers.set_seed seeds both
    return run()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    script = Script(tmp_path_factory.mktemp("vocab"))
    example = next(iter(script.loader()))
    split = graphsplit.split(script.step, (example,))
    return script, example, split


def test_the_trainer_s_length_grouped_batches(built):
    script, _example, _split = built
    assert isinstance(
        script.trainer._get_train_sampler(), transformers.trainer_pt_utils.LengthGroupedSampler
    )
    batches = list(script.loader())
    widths = [b["input_values"].shape[1] for b in batches]
    assert [b["input_values"].shape[0] for b in batches] == [3] * 8 + [2]
    assert len(set(widths)) == 9 and widths[0] == max(CLIP_LENGTHS)  # the longest first
    # Within a megabatch (two batches) the clips come longest first.
    for first, second in zip(batches[2::2], batches[3::2], strict=False):
        assert first["attention_mask"].sum(1).min() >= second["attention_mask"].sum(1).max()


def test_verifies_on_the_example_and_the_short_last_batch(built):
    script, example, split = built
    last = list(script.loader())[-1]
    for seed, batch in enumerate([example, last]):
        np.random.seed(seed)
        checks = graphsplit.verify(script.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert_stage1_holds_no_trainable(split)


def test_the_frozen_feature_encoder_is_cached_and_not_held(built):
    script, _example, split = built
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".feature_extractor." in name for name in held), sorted(held)
    trainable = {n for n, p in script.model.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in held} >= trainable - {"masked_spec_embed"}
    # The module-level path (Wav2Vec2ForCTC.forward reads tensor values) caches the conv
    # encoder's call and stores no audio: stage 2 reads only its shape.
    assert split.path == "calls"
    assert set(split.boundary) == {
        "input_values__shape",
        "attention_mask",
        "labels",
        "model_wav2vec2_feature_extractor__0__out",
    }


@pytest.fixture(scope="module")
def cache_run(built, tmp_path_factory):
    script, _example, split = built
    folder = tmp_path_factory.mktemp("cache") / "cache"
    return cache_whole_loader(
        split, script.step, script.loader(), folder, script.params, wrap=_numpy_seeded
    )


def test_whole_loader_cached_each_sample_right(built, cache_run):
    """Every sample equals stage 1 on its raw batch, and stage 2 on each written batch trains
    as the step on the raw batch (checked in ``cache_whole_loader``)."""
    _script, _example, split = built
    assert cache_run.wrong_samples == []
    keys = [int(cache_run.cached[row]["key"]) for row in range(len(cache_run.cached))]
    assert sorted(keys) == list(range(26)) and keys != sorted(keys)  # the sampler's order
    # One bucket per padded length (the conv output's length, the mask's and the labels').
    assert len(cache_run.cached.buckets()) == 9
    # The module-level path makes no plan per shape: it takes any padded length as it comes.
    assert split.path == "calls" and cache_run.plans == 0


def _eager_rows(cache_run):
    """``eager(keys)``: the same samples at the padding stage 1 saw (rows of their raw batch),
    in the order given."""
    by_key = {}
    keys_in_order = [str(cache_run.cached[row]["key"]) for row in range(len(cache_run.cached))]
    row = 0
    for raw in cache_run.raw_batches:
        for offset in range(raw["input_values"].shape[0]):
            by_key[keys_in_order[row]] = (raw, offset)
            row += 1

    def eager(keys):
        (raw,) = {id(by_key[key][0]): by_key[key][0] for key in keys}.values()
        picks = torch.tensor([by_key[key][1] for key in keys])
        return {name: value[picks] for name, value in raw.items()}

    return eager


def test_an_epoch_of_the_cache_in_bucket_order(built, cache_run):
    """``cached.loader(3, shuffle=False)``: each bucket (one padded length) in cache order, so
    each batch is a raw batch as stage 1 saw it; stage 2 trains as the step on it."""
    script, _example, split = built
    seen = train_epoch_from_cache(
        split,
        script.step,
        cache_run.cached,
        _eager_rows(cache_run),
        script.params,
        batch_size=BATCH_SIZE,
        shuffle=False,
        wrap=_numpy_seeded,
    )
    assert sorted(len(keys) for keys in seen) == [2] + [3] * 8
