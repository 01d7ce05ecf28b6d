"""Conformance: ``run_audio_classification.py``'s data, map-style and streamed, through the cache.

transformers' ``examples/pytorch/audio-classification/run_audio_classification.py`` (commit
049d2bf1) trains ``AutoModelForAudioClassification`` with ``model.freeze_feature_encoder()``
(the convolutional waveform encoder frozen, the transformer and head trained, SpecAugment and
dropouts active). Its data: ``raw_datasets["train"].set_transform(train_transforms,
output_all_columns=False)``, where ``train_transforms`` cuts each clip at a random offset
(``random_subsample``, Python's ``random.randint``) to ``--max_length_seconds`` and runs the
feature extractor (both copied verbatim); the ``Trainer`` batches with its default collator for
a feature extractor, ``DataCollatorWithPadding(feature_extractor)`` (each batch padded to its
longest clip, with an attention mask), and its ``compute_loss`` runs
``outputs = model(**inputs); loss = outputs["loss"]``.

Fed as users feed it: the script's map-style dataset (the random crop makes it a dataset that
draws random numbers: ``graphsplit.cache`` must say so with a ``RandomDatasetWarning``), and
the same data streamed as ``load_dataset(..., streaming=True)`` gives it:
``to_iterable_dataset(num_shards=2).shuffle(seed=42, buffer_size=4).map(train_transforms,
batched=True)``, no ``__len__``, samples numbered as they come. The round trip: the rows of
each raw batch, read back from disk, train stage 2 exactly as the step on that raw batch (loss
and every trainable gradient bit for bit, the random crop drawn under the same seed for both);
each row's cached label is its sample's. A rerun after ``set_epoch(1)`` (another shuffle) on the
finished cache must be refused, naming the samples that changed.

The default path: the trace into SpecAugment draws with NumPy, then feeds a traced size to
``np.ones`` and fails with NumPy's ``ValueError``; the trace names the draw instead (a
``TraceError``), so ``path="auto"`` falls back to the module-level path (it used to let NumPy's
error out of ``split()``). The data tests split with ``path="calls"``, as the fallback does.

Tiny ``Wav2Vec2Config`` with random weights; clips of 0.15 to 0.35 s at 16 kHz, cut to 0.3 s.
SpecAugment draws with NumPy in the step, so both sides of every comparison seed NumPy too.
"""

from __future__ import annotations

import random
import warnings
from random import randint

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.errors import RandomDatasetWarning, StaleCacheError
from tests.conformance.unseen_checks import loss_and_grads, stage2_top_modules

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

LABELS = ["yes", "no", "up"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class data_args:  # the script's DataTrainingArguments, with a short --max_length_seconds
    audio_column_name = "audio"
    label_column_name = "label"
    max_length_seconds = 0.3


def _model():
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        classifier_proj_size=16,
        num_labels=len(LABELS),
        mask_time_length=2,
    )
    model = transformers.Wav2Vec2ForSequenceClassification(config)
    # freeze the convolutional waveform encoder
    model.freeze_feature_encoder()
    model.train()
    return model


model = _model()
PARAMS = [param for param in model.parameters() if param.requires_grad]
feature_extractor = transformers.Wav2Vec2FeatureExtractor(
    feature_size=1,
    sampling_rate=16000,
    padding_value=0.0,
    do_normalize=True,
    return_attention_mask=True,
)
model_input_name = feature_extractor.model_input_names[0]
data_collator = transformers.DataCollatorWithPadding(feature_extractor)  # the Trainer's default


def random_subsample(wav: np.ndarray, max_length: float, sample_rate: int = 16000):
    """Randomly sample chunks of `max_length` seconds from the input audio"""
    sample_length = int(round(sample_rate * max_length))  # noqa: RUF046 (the script's)
    if len(wav) <= sample_length:
        return wav
    random_offset = randint(0, len(wav) - sample_length - 1)
    return wav[random_offset : random_offset + sample_length]


def train_transforms(batch):
    """Apply train_transforms across a batch."""
    subsampled_wavs = []
    for audio in batch[data_args.audio_column_name]:
        wav = random_subsample(
            audio["array"],
            max_length=data_args.max_length_seconds,
            sample_rate=feature_extractor.sampling_rate,
        )
        subsampled_wavs.append(wav)
    inputs = feature_extractor(subsampled_wavs, sampling_rate=feature_extractor.sampling_rate)
    output_batch = {model_input_name: inputs.get(model_input_name)}
    output_batch["labels"] = list(batch[data_args.label_column_name])

    return output_batch


def training_step(inputs):  # Trainer.compute_loss, as the script's Trainer runs it
    outputs = model(**inputs)
    loss = outputs["loss"]
    return loss


def _raw_dataset(count: int = 9):
    """An ``audiofolder``-like table: decoded clips (``{"array", "sampling_rate"}``), labels."""
    generator = np.random.default_rng(0)
    # 0.15 to 0.35 s: the first clip is longer than --max_length_seconds (cut at random),
    # batches of 3 pad to 0.3, 0.25 and 0.2 s
    lengths = [5600, 2400, 3200, 4000, 2400, 3200, 2400, 2400, 3200][:count]
    audio = [
        {"array": (0.1 * generator.standard_normal(n)).astype(np.float32), "sampling_rate": 16000}
        for n in lengths
    ]
    features = datasets.Features(
        {
            "audio": {
                "array": datasets.Sequence(datasets.Value("float32")),
                "sampling_rate": datasets.Value("int64"),
            },
            "label": datasets.ClassLabel(names=LABELS),
        }
    )
    return datasets.Dataset.from_dict(
        {"audio": audio, "label": [index % 3 for index in range(count)]}, features=features
    )


def _train_dataset():
    train = _raw_dataset()
    # Set the training transforms
    train.set_transform(train_transforms, output_all_columns=False)
    return train


def _plain(batch):
    return dict(batch)


def _first_batch():
    random.seed(0)
    loader = DataLoader(_train_dataset(), batch_size=3, collate_fn=data_collator)
    return _plain(next(iter(loader)))


def test_the_default_path_splits_the_script_s_model():
    split = graphsplit.split(training_step, (_first_batch(),))
    assert split.path == "calls"
    assert "Random numbers were drawn while tracing (numpy.random generator)" in split.reason
    assert "modeling_wav2vec2.py" in split.reason  # the line that drew


@pytest.fixture(scope="module")
def split():
    """path="calls", as the default path takes (the test above)."""
    return graphsplit.split(training_step, (_first_batch(),), path="calls")


class Seeded:
    """The loader, its Python ``random`` seeded before every pass (the random crop drawn
    alike by the raw pass and by the cache's)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        random.seed(0)
        return iter(self.loader)


def test_the_split_verifies_and_stage2_leaves_the_feature_encoder_out(split):
    random.seed(0)
    loader = DataLoader(_train_dataset(), batch_size=3, collate_fn=data_collator)
    batches = list(loader)
    assert len({b["input_values"].shape[1] for b in batches}) > 1  # padded per batch
    random.seed(1)
    other = next(iter(DataLoader(_train_dataset(), batch_size=2, collate_fn=data_collator)))
    for batch in (batches[0], other):
        assert all(c.ok for c in graphsplit.verify(training_step, split, (_plain(batch),)))
    held = {name for name, _ in split.stage2.named_parameters()}
    assert held and not any("feature_extractor.conv_layers" in name for name in held), held
    assert stage2_top_modules(split) == {"model"}  # the model, less its frozen conv encoder
    assert any("feature_extractor" in name for name in split.boundary)


def test_the_script_s_random_crop_is_named_by_a_warning(split, tmp_path):
    loader = DataLoader(_train_dataset(), batch_size=3, collate_fn=data_collator)
    with pytest.warns(RandomDatasetWarning) as caught:
        graphsplit.cache(split, Seeded(loader).loader, tmp_path / "cache", progress=False)
    message = str(caught[0].message)
    assert "input_values" in message


def assert_same_step(expected, actual, params, seed):
    """``unseen2_data_checks.assert_same_step``, where a parameter may get no gradient on both
    sides: layerdrop skips a layer, and ``masked_spec_embed`` has none when SpecAugment masks
    no span (short clips)."""
    want_loss, want = loss_and_grads(expected, params, seed)
    got_loss, got = loss_and_grads(actual, params, seed)
    assert torch.equal(want_loss, got_loss), (want_loss, got_loss)
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        assert (a is None and b is None) or (
            a is not None and b is not None and torch.equal(a, b)
        ), f"gradient {index} differs"
    assert any(grad is not None for grad in want)


def _numpy_seeded(seed, run, batch):
    np.random.seed(seed)  # SpecAugment's _compute_mask_indices draws with np.random
    return run(batch)


def _round_trip(split, loader, folder):
    """The script's loader (``Seeded``) cached; stage 2 on each raw batch's cached rows trains
    as the step on the raw batch, every row keyed by its position."""
    raw_batches = [_plain(batch) for batch in Seeded(loader)]
    info = graphsplit.cache(split, Seeded(loader), folder, progress=False)
    cached = graphsplit.CachedDataset(folder, split)
    total = sum(len(batch["labels"]) for batch in raw_batches)
    assert info.num_samples == len(cached) == total
    assert [cached[row]["key"] for row in range(total)] == [str(i) for i in range(total)]
    row = 0
    for seed, raw in enumerate(raw_batches):
        rows = [cached[row + offset] for offset in range(len(raw["labels"]))]
        row += len(rows)
        assert_same_step(
            lambda raw=raw, seed=seed: _numpy_seeded(seed, training_step, raw),
            lambda rows=rows, seed=seed: _numpy_seeded(
                seed, lambda batch: split.stage2(**batch), graphsplit.collate(rows)
            ),
            PARAMS,
            seed,
        )
    assert len(raw_batches) == 3
    return cached


def test_the_map_style_dataset_caches_exactly(split, tmp_path):
    loader = DataLoader(_train_dataset(), batch_size=3, collate_fn=data_collator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomDatasetWarning)
        cached = _round_trip(split, loader, tmp_path / "cache")
    _labels_match(cached, [index % 3 for index in range(9)])


def _labels_match(cached, labels):
    for row in range(len(cached)):
        item = cached[row]
        assert int(item["labels"]) == labels[row], (row, item["labels"])


def _stream(epoch: int = 0):
    stream = (
        _raw_dataset()
        .to_iterable_dataset(num_shards=2)
        .shuffle(seed=42, buffer_size=4)
        .map(train_transforms, batched=True, remove_columns=["audio", "label"])
    )
    stream.set_epoch(epoch)
    return stream


def test_a_shuffled_stream_without_len_caches_exactly(split, tmp_path):
    stream = _stream()
    assert not hasattr(stream, "__len__")
    loader = DataLoader(stream, batch_size=3, collate_fn=data_collator)
    random.seed(0)
    labels = [int(label) for batch in loader for label in batch["labels"]]
    assert labels != [index % 3 for index in range(9)]  # shuffled
    cached = _round_trip(split, loader, tmp_path / "cache")
    _labels_match(cached, labels)


def test_a_rerun_on_another_shuffle_is_refused_naming_the_changed_samples(split, tmp_path):
    loader = DataLoader(_stream(0), batch_size=3, collate_fn=data_collator)
    graphsplit.cache(split, Seeded(loader), tmp_path / "cache", progress=False)
    reshuffled = DataLoader(_stream(1), batch_size=3, collate_fn=data_collator)
    with pytest.raises(StaleCacheError) as caught:
        graphsplit.cache(split, Seeded(reshuffled), tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "other data than the loader yields now" in message and "changed" in message
    assert "overwrite=True" in message
