"""Conformance: ``run_glue_no_trainer.py``'s data, cached through the samplers users put under it.

transformers' ``examples/pytorch/text-classification/run_glue_no_trainer.py`` (commit 0310c247)
tokenizes with ``raw_datasets.map(preprocess_function, batched=True, remove_columns=...)``
(``padding=False``: no padding at map time), pads each batch to its longest with
``DataCollatorWithPadding(tokenizer, pad_to_multiple_of=None)`` and trains with the loop body
``outputs = model(**batch); loss = outputs.loss`` (both copied verbatim). The model is a
``BertForSequenceClassification`` from a tiny config with its encoder frozen
(``model.bert.requires_grad_(False)``, the usual "train the head only" edit of the script): the
trainable part is the classifier head, after the head's own dropout (active: ``model.train()``).
The encoder's dropouts are 0 in the config, so its output is cacheable.

The data here is the script's, then fed as users change the loader around it:
``.with_format("torch")`` columns (``DataCollatorWithPadding`` pads tensors), a ``BatchSampler``
of their own that groups indices by length (fewer pad tokens) with ``num_workers=2``,
transformers' own ``LengthGroupedSampler`` (what ``group_by_length=True`` gives the Trainer: a
random order drawn once per iteration), and ``DistributedSampler(num_replicas=1,
shuffle=False)`` (what a script written for ``torchrun`` keeps when run on one process). Each
loader is cached with ``graphsplit.cache`` as it is; the cache holds each sample under its
dataset index, and stage 2 on each batch's cached rows trains exactly as the step on the raw
batch (loss and classifier gradients bit for bit).

Also the refusals a user meets: the script's own ``shuffle=True`` loader (and a ``RandomSampler``
inside a batch sampler) must be refused naming the sampler and the fix. Expected failures: the
refusal of a ``RandomSampler`` inside a ``BatchSampler`` names the loader's default
``SequentialSampler``; and ``CachedDataset.loader`` batches rows cached at different padded
lengths together (the cut after BERT's pooler leaves no length dim), so its batches are not the
step on those samples bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

import graphsplit
from graphsplit.errors import CacheError
from tests.conformance.unseen2_data_checks import assert_cache_round_trip, assert_same_step
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

WORDS = [
    *("the", "a", "film", "movie", "is", "was", "not", "very", "good", "bad"),
    *("great", "boring", "and", "but", "plot", "acting", "fun", "long", "i", "liked"),
]
SENTENCES = [
    "the film is good",
    "a very boring movie",
    "i liked the plot but the acting was bad",
    "great",
    "the movie was long and boring and not fun",
    "not good",
    "a fun film",
    "the acting is great and the plot is very good",
    "bad",
    "i liked it",
    "the plot was not very good but the film is fun",
]
LABELS = [1, 0, 0, 1, 0, 0, 1, 1, 0, 1, 1]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.1,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    model.bert.requires_grad_(False)  # train the head only
    model.train()
    return model


model = _model()  # the script's global
PARAMS = [param for param in model.parameters() if param.requires_grad]
tokenizer = word_tokenizer(WORDS, eos=None)
sentence1_key, sentence2_key = "sentence", None  # task_to_keys["sst2"]
padding = False  # "max_length" if args.pad_to_max_length else False
label_to_id = None


class args:  # the script's argparse namespace, defaults
    max_length = 128
    gradient_accumulation_steps = 1


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


def _train_dataset(torch_format: bool = False):
    raw = datasets.Dataset.from_dict({"sentence": SENTENCES, "label": LABELS})
    processed = raw.map(preprocess_function, batched=True, remove_columns=raw.column_names)
    return processed.with_format("torch") if torch_format else processed


data_collator = transformers.DataCollatorWithPadding(tokenizer, pad_to_multiple_of=None)


def _plain(batch):
    """The collator's ``BatchEncoding`` as a dict (what the split's example is made from)."""
    return dict(batch)


@pytest.fixture(scope="module")
def split():
    loader = DataLoader(_train_dataset(), collate_fn=data_collator, batch_size=4)
    return graphsplit.split(training_step, (_plain(next(iter(loader))),))


def test_the_split_verifies_on_two_batch_sizes_and_leaves_the_encoder_out(split):
    loader = DataLoader(_train_dataset(), collate_fn=data_collator, batch_size=4)
    first, _, last = list(loader)
    assert first["input_ids"].shape[0] == 4 and last["input_ids"].shape[0] == 3
    for batch in (first, last):
        assert all(c.ok for c in graphsplit.verify(training_step, split, (_plain(batch),)))
    stage2 = {name for name, _ in split.stage2.named_parameters()}
    assert stage2 and all("classifier" in name for name in stage2), stage2
    assert not any(".bert." in name or name.startswith("bert.") for name in stage2)
    assert "bert" not in stage2_top_modules(split)


def test_torch_format_columns_padded_per_batch(split, tmp_path):
    """``.with_format("torch")``: the collator pads tensors; 11 samples at 4: 4, 4, 3, each
    batch at its own longest length."""
    loader = DataLoader(_train_dataset(torch_format=True), collate_fn=data_collator, batch_size=4)
    batches = list(loader)
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 3]
    assert len({b["input_ids"].shape[1] for b in batches}) == 3
    cached = assert_cache_round_trip(
        split, training_step, loader, tmp_path / "cache", PARAMS, expected_keys=None
    )
    assert [cached[row]["key"] for row in range(len(cached))] == [str(i) for i in range(11)]
    # The cut is after BERT's pooler: a row has no length dim, so one bucket for all three
    # padded lengths (see the last test for what that does to stage 2's own loader).
    assert split.path == "trace" and len(cached.buckets()) == 1


class GroupByLength(BatchSampler):
    """A user's batch sampler: indices sorted by token count, cut into batches (fewer pads)."""

    def __init__(self, lengths, batch_size: int) -> None:
        self.order = sorted(range(len(lengths)), key=lambda index: (lengths[index], index))
        self.batch_size = batch_size

    def __iter__(self):
        for start in range(0, len(self.order), self.batch_size):
            yield self.order[start : start + self.batch_size]

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)


def test_a_length_grouping_batch_sampler_with_two_workers(split, tmp_path):
    dataset = _train_dataset()
    lengths = [len(ids) for ids in dataset["input_ids"]]
    sampler = GroupByLength(lengths, batch_size=3)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=data_collator, num_workers=2)
    keys = [str(index) for indices in sampler for index in indices]
    assert keys != sorted(keys, key=int)  # not the dataset order
    cached = assert_cache_round_trip(
        split, training_step, loader, tmp_path / "cache", PARAMS, expected_keys=keys
    )
    # Each row is its own sample: its cached labels are the dataset's label at its index.
    for row in range(len(cached)):
        item = cached[row]
        labels = [
            value
            for name, value in item.items()
            if isinstance(value, torch.Tensor) and value.dtype == torch.int64 and name != "key"
        ]
        assert len(labels) == 1 and int(labels[0]) == LABELS[int(item["key"])]


def test_transformers_length_grouped_sampler_keys_rows_by_dataset_index(split, tmp_path):
    """``LengthGroupedSampler`` draws a new order on every iteration: the cache keeps the one
    order it read, each row under its dataset index, and stage 2 on the rows of each written
    batch trains as the step on those samples collated in that order."""
    dataset = _train_dataset()
    lengths = [len(ids) for ids in dataset["input_ids"]]
    sampler = transformers.trainer_pt_utils.LengthGroupedSampler(
        batch_size=3, lengths=lengths, generator=torch.Generator().manual_seed(0)
    )
    loader = DataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=data_collator)
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    keys = [cached[row]["key"] for row in range(len(cached))]
    assert info.num_samples == len(cached) == 11
    assert sorted(keys, key=int) == [str(i) for i in range(11)]
    row, seed = 0, 0
    while row < len(cached):
        size = min(3, len(cached) - row)
        # LengthGroupedSampler puts the longest sample first, and the batches of one megabatch
        # in sorted order; the rows of one written batch share its padded length.
        rows = [cached[row + offset] for offset in range(size)]
        raw = data_collator([dataset[int(item["key"])] for item in rows])
        assert_same_step(
            lambda raw=raw: training_step(_plain(raw)),
            lambda rows=rows: split.stage2(**graphsplit.collate(rows)),
            PARAMS,
            seed,
        )
        row += size
        seed += 1


def test_a_distributed_sampler_of_one_replica_unshuffled(split, tmp_path):
    """A ``torchrun`` script's sampler on one process, ``shuffle=False``: the dataset order,
    as a plain loader reads it. Refused, naming the sampler and the fix."""
    dataset = _train_dataset()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    assert list(sampler) == list(range(len(dataset)))
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=data_collator)
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "DistributedSampler" in message and "no sampler" in message
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_the_script_s_shuffled_loader_is_refused_naming_the_sampler(split, tmp_path):
    loader = DataLoader(_train_dataset(), shuffle=True, collate_fn=data_collator, batch_size=4)
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "RandomSampler" in message and "shuffle=False" in message


def test_a_random_sampler_inside_a_batch_sampler_is_named(split, tmp_path):
    dataset = _train_dataset()
    batches = BatchSampler(RandomSampler(dataset), batch_size=4, drop_last=False)
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=data_collator)
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "its batch sampler's sampler is a RandomSampler" in message
    assert "SequentialSampler" not in message


@pytest.mark.xfail(
    strict=True,
    reason="graphsplit/caching/read/dataset.py:CachedDataset.buckets groups rows by their "
    "boundary shapes (and plan) only; the cut is after BERT's pooler, so a row holds no length "
    "dim and rows computed at padded lengths 1 and 9 share a bucket. cached.loader then batches "
    "'great' (cached from a batch padded to 1) with a sample of length 9: the step on those two "
    "samples pads 'great' to 9 and its pooled output differs in the last bits (attention over "
    "more masked keys), so loss/classifier gradient differ from stage 2 on the cached rows. "
    "The manifest records no stage-1 input shape per row (caching/format), so nothing can keep "
    "them apart; fix: record each row's stage-1 input shapes (the raw batch's padded length) in "
    "the shard records and add them to the bucket key",
)
def test_the_cache_read_back_by_length_trains_as_the_step(split, tmp_path):
    """Stage 2's own loader over the length-grouped cache: batches of one shape, every
    sample once per epoch, each batch exactly the step on those samples."""
    dataset = _train_dataset()
    lengths = [len(ids) for ids in dataset["input_ids"]]
    loader = DataLoader(
        dataset, batch_sampler=GroupByLength(lengths, batch_size=2), collate_fn=data_collator
    )
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    stage2 = cached.loader(batch_size=2, seed=0)
    stage2.set_epoch(0)
    indices = stage2.batch_sampler.epoch_batches(0)
    seen = []
    for seed, (batch, batch_rows) in enumerate(zip(stage2, indices, strict=True)):
        keys = [cached[index]["key"] for index in batch_rows]
        seen += keys
        raw = data_collator([dataset[int(key)] for key in keys])
        assert_same_step(
            lambda raw=raw: training_step(_plain(raw)),
            lambda batch=batch: split.stage2(**batch),
            PARAMS,
            seed,
        )
    assert sorted(seen, key=int) == [str(i) for i in range(11)]
