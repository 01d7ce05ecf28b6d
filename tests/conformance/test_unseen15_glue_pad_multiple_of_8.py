"""Conformance: ``run_glue_no_trainer.py`` under mixed precision's ``pad_to_multiple_of=8``, a
frozen RoBERTa encoder, every batch its own padded length, the last batch shorter.

transformers' ``examples/pytorch/text-classification/run_glue_no_trainer.py`` tokenizes with
``padding=False`` in ``preprocess_function`` (copied verbatim), builds its collator as::

    # ... When using mixed precision, we add `pad_to_multiple_of=8` to pad all tensors to
    # multiple of 8s, which will enable the use of Tensor Cores on NVIDIA hardware ...
    if accelerator.mixed_precision == "fp8":
        pad_to_multiple_of = 16
    elif accelerator.mixed_precision != "no":
        pad_to_multiple_of = 8
    else:
        pad_to_multiple_of = None
    data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

(here ``mixed_precision="bf16"`` chose 8; the step itself runs in float32 on CPU), loads with
``DataLoader(train_dataset, shuffle=True, collate_fn=data_collator, batch_size=...)``
(``shuffle=False`` for the caching pass: graphsplit refuses a random sampler) and trains with
the loop body ``outputs = model(**batch); loss = outputs.loss; loss = loss /
args.gradient_accumulation_steps``. The model is a ``RobertaForSequenceClassification`` from a
tiny config with its encoder frozen (``model.roberta.requires_grad_(False)``, "train the head
only"); the trainable part is the classification head (``dense``, ``tanh``, ``out_proj``, its
dropouts active in ``model.train()``). The encoder's dropouts are 0, so its output is cacheable.

Data: 18 sentences of 7 to 40 tokens in dataset order, batches of 4 (``drop_last=False``: a
last batch of 2), padded to 16, 40, 24, 32 and 8: five padded lengths, one per batch.

The cut is at the frozen encoder's whole sequence output (``(length, 32)`` per sample): the
head's ``features[:, 0, :]`` is inside the trainable ``classifier``, which stage 2 calls as a
module, so the cheaper CLS row cannot be the boundary. Each row thus keeps its padded length,
each padded length is its own bucket and ``cached.loader`` never mixes paddings (unlike
unseen12's BERT, whose pooler is frozen and cut after).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.utils.data import DataLoader

import graphsplit
from tests.conformance.unseen15_d_checks import cache_whole_loader, train_epoch_from_cache
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

WORDS = [
    *("the", "a", "film", "movie", "is", "was", "not", "very", "good", "bad"),
    *("great", "boring", "and", "but", "plot", "acting", "fun", "long", "i", "liked"),
]
# Token counts in dataset order: batch maxima 12, 40, 20, 31 and 8 -> 16, 40, 24, 32, 8.
LENGTHS = [9, 12, 7, 10, 40, 18, 25, 33, 20, 14, 11, 17, 31, 22, 29, 27, 8, 7]
assert min(LENGTHS) == 7 and max(LENGTHS) == 40


def _sentences() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for length in LENGTHS]


SENTENCES = _sentences()
LABELS = [index % 2 for index in range(len(SENTENCES))]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: the module's fixtures (split, cache) run on one thread too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model():
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=len(WORDS) + 2,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.1,
        pad_token_id=0,
        num_labels=2,
    )
    model = transformers.RobertaForSequenceClassification(config)
    model.roberta.requires_grad_(False)  # train the head only
    model.train()
    return model


model = _model()  # the script's global
PARAMS = [param for param in model.parameters() if param.requires_grad]
tokenizer = word_tokenizer(WORDS, eos=None)
sentence1_key, sentence2_key = "sentence", None  # task_to_keys["sst2"]
padding = False  # "max_length" if args.pad_to_max_length else False
label_to_id = None
pad_to_multiple_of = 8  # accelerator.mixed_precision != "no"


class args:  # the script's argparse namespace, defaults
    max_length = 128
    gradient_accumulation_steps = 1
    per_device_train_batch_size = 4


def preprocess_function(examples):  # run_glue_no_trainer.py's, verbatim
    # Tokenize the texts
    texts = (
        (examples[sentence1_key],)
        if sentence2_key is None
        else (examples[sentence1_key], examples[sentence2_key])
    )
    result = tokenizer(*texts, padding=padding, max_length=args.max_length, truncation=True)

    if "label" in examples:
        if label_to_id is not None:
            # Map labels to IDs (not necessary for GLUE tasks)
            result["labels"] = [label_to_id[l] for l in examples["label"]]  # noqa: E741
        else:
            # In all cases, rename the column to labels because the model will expect that.
            result["labels"] = examples["label"]
    return result


def training_step(batch):  # the loop body of run_glue_no_trainer.py
    outputs = model(**batch)
    loss = outputs.loss
    loss = loss / args.gradient_accumulation_steps
    return loss


raw = datasets.Dataset.from_dict({"sentence": SENTENCES, "label": LABELS})
train_dataset = raw.map(preprocess_function, batched=True, remove_columns=raw.column_names)
data_collator = transformers.DataCollatorWithPadding(
    tokenizer, pad_to_multiple_of=pad_to_multiple_of
)


def _loader() -> DataLoader:
    return DataLoader(
        train_dataset,
        shuffle=False,
        collate_fn=data_collator,
        batch_size=args.per_device_train_batch_size,
    )


@pytest.fixture(scope="module")
def split():
    return graphsplit.split(training_step, (next(iter(_loader())),))


def test_every_batch_its_own_padded_length():
    batches = list(_loader())
    assert [b["input_ids"].shape for b in batches] == [
        (4, 16),
        (4, 40),
        (4, 24),
        (4, 32),
        (2, 8),
    ]
    assert isinstance(batches[0], transformers.BatchEncoding)


def test_split_verifies_on_two_sizes_and_holds_the_head_only(split):
    started = time.perf_counter()
    batches = list(_loader())
    for seed, batch in enumerate((batches[0], batches[-1], batches[1])):
        checks = graphsplit.verify(training_step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert_stage1_holds_no_trainable(split)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert held and all(".classifier." in f".{name}" for name in held), sorted(held)
    assert "roberta" not in stage2_top_modules(split)
    assert time.perf_counter() - started < 60


def test_whole_loader_cached_each_sample_right(split, tmp_path):
    """The five padded lengths through one cache: every sample equals stage 1 on its raw
    batch, and stage 2 on each written batch trains as the step on the raw batch."""
    run = cache_whole_loader(split, training_step, _loader(), tmp_path / "cache", PARAMS)
    assert run.wrong_samples == []
    assert [run.cached[row]["key"] for row in range(len(run.cached))] == [str(i) for i in range(18)]
    assert run.plans == 1, [str(plan.signature) for plan in split.plans]


def test_an_epoch_from_the_cache_loader_trains_as_the_step(split, tmp_path):
    """The cut is at the frozen encoder's output (the head's ``[:, 0]`` slice is inside the
    trainable ``classifier``, called as a module), so a row keeps its padded length and each
    padded length is its own bucket: ``cached.loader(4)`` gives back each raw batch's samples,
    shuffled, and the step on them (the script's collator) pads to the same length."""
    run = cache_whole_loader(split, training_step, _loader(), tmp_path / "cache", PARAMS)
    assert sorted(len(rows) for rows in run.cached.buckets().values()) == [2, 4, 4, 4, 4]

    def eager(keys):
        return data_collator([train_dataset[int(key)] for key in keys])

    seen = train_epoch_from_cache(
        split, training_step, run.cached, eager, PARAMS, batch_size=args.per_device_train_batch_size
    )
    assert len(seen) == 5


def test_an_epoch_of_batches_of_three_at_the_cached_padding(split, tmp_path):
    """Batches of 3 out of buckets of 4: a batch is a subset of a raw batch, trained at the
    padding stage 1 saw (the samples padded to the row's length, ``padding="max_length"``),
    not at their own longest, as docs/howto.md "Padded sequences" says."""
    run = cache_whole_loader(split, training_step, _loader(), tmp_path / "cache", PARAMS)
    cached = run.cached

    def eager(keys):
        length = cached.shapes(int(keys[0]))["model_roberta_0"][0]
        at_length = transformers.DataCollatorWithPadding(
            tokenizer, padding="max_length", max_length=length
        )
        return at_length([train_dataset[int(key)] for key in keys])

    seen = train_epoch_from_cache(split, training_step, cached, eager, PARAMS, batch_size=3)
    assert sorted(len(keys) for keys in seen) == [1, 1, 1, 1, 2, 3, 3, 3, 3]
