"""Conformance: multiple choice as transformers' ``run_swag_no_trainer.py`` trains it, base frozen.

transformers ``examples/pytorch/multiple-choice/run_swag_no_trainer.py``: the script's own
``preprocess_function`` (each context repeated for the four endings, tokenized as pairs, then
un-flattened into four choices per example), ``DataCollatorForMultipleChoice`` (dynamic
padding: ``input_ids`` / ``token_type_ids`` / ``attention_mask`` of shape ``(batch, 4, seq)``,
``labels`` of shape ``(batch,)``) and the loop body::

    outputs = model(**batch)
    loss = outputs.loss

The model is ``BertForMultipleChoice`` with the BERT base frozen (``model.bert.requires_grad_
(False)``: a linear probe, only ``classifier`` in the optimizer) in train mode. Its
``forward`` flattens the choices into the batch (``input_ids.view(-1, input_ids.size(-1))``),
runs BERT on ``batch * 4`` rows, and reshapes the classifier's logits back with
``logits.view(-1, num_choices)``. The encoder's dropout is off in the config
(``hidden_dropout_prob=0``: a frozen base with live dropout draws random masks and cannot be
cached at all); the head's dropout (``classifier_dropout=0.1``) is live.

What must hold: the step splits exactly (loss and the classifier's gradients bit for bit, on
the example and on a batch of another size), and the cache round trip through the disk trains
stage 2 exactly. What a user would expect but graphsplit does not do (xfail, strict): cache
BERT's pooled output, so stage 2 holds only the classifier. BERT's rows are ``batch * 4`` (the
batch folded into the choices), which graphsplit classifies as no batch layout at all.

Tiny config: BERT 32 wide, 2 layers, a word-level tokenizer over a few words, random weights.
"""

from __future__ import annotations

from itertools import chain

import pytest
import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

ENDINGS = 4
MAX_SEQ_LENGTH = 16

SWAG = {  # the swag "regular" columns the script reads
    "sent1": [
        "the man opens a door",
        "she cooks dinner",
        "a dog runs in the park",
        "the man sits down",
        "she walks away",
        "a dog eats",
        "the man cooks",
    ],
    "sent2": ["he", "she", "it", "he", "she", "it", "he"],
    "ending0": ["walks in", "eats it", "sits", "eats dinner", "runs", "runs away", "eats"],
    "ending1": ["sits down", "runs", "eats it then", "walks", "sits down", "sits", "opens it"],
    "ending2": ["runs away", "sits down then", "walks away", "runs", "cooks", "walks", "runs"],
    "ending3": ["eats it then", "walks away", "runs", "opens a door", "eats", "eats it", "sits"],
    "label": [0, 2, 1, 3, 0, 2, 1],
}


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A BERT-style fast tokenizer (``[CLS] a [SEP] b [SEP]``, ``token_type_ids``) over the
    dataset's words: nothing to download."""
    words = " ".join(text for column, texts in SWAG.items() if column != "label" for text in texts)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {word: index for index, word in enumerate([*specials, *dict.fromkeys(words.split())])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def _train_dataset(tokenizer) -> datasets.Dataset:
    """The script's preprocessing, verbatim (``padding=False``: the collator pads)."""
    raw = datasets.Dataset.from_dict(SWAG)
    column_names = raw.column_names
    ending_names = [f"ending{i}" for i in range(4)]
    context_name = "sent1"
    question_header_name = "sent2"
    label_column_name = "label" if "label" in column_names else "labels"
    padding = False

    def preprocess_function(examples):
        first_sentences = [[context] * 4 for context in examples[context_name]]
        question_headers = examples[question_header_name]
        second_sentences = [
            [f"{header} {examples[end][i]}" for end in ending_names]
            for i, header in enumerate(question_headers)
        ]
        labels = examples[label_column_name]

        # Flatten out
        first_sentences = list(chain(*first_sentences))
        second_sentences = list(chain(*second_sentences))

        # Tokenize
        tokenized_examples = tokenizer(
            first_sentences,
            second_sentences,
            max_length=MAX_SEQ_LENGTH,
            padding=padding,
            truncation=True,
        )
        # Un-flatten
        tokenized_inputs = {
            k: [v[i : i + 4] for i in range(0, len(v), 4)] for k, v in tokenized_examples.items()
        }
        tokenized_inputs["labels"] = labels
        return tokenized_inputs

    return raw.map(preprocess_function, batched=True, remove_columns=raw.column_names)


def _model(vocab_size: int) -> transformers.BertForMultipleChoice:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.1,
    )
    model = transformers.BertForMultipleChoice(config)
    model.bert.requires_grad_(False)  # a linear probe: only the classifier trains
    model.train()
    return model


def build():
    tokenizer = _tokenizer()
    train_dataset = _train_dataset(tokenizer)
    model = _model(len(tokenizer))
    data_collator = transformers.DataCollatorForMultipleChoice(
        tokenizer, pad_to_multiple_of=None, return_tensors="pt"
    )

    def training_step(batch):  # run_swag_no_trainer.py's loop body
        outputs = model(**batch)
        loss = outputs.loss
        return loss

    loader = torch.utils.data.DataLoader(
        train_dataset, shuffle=False, collate_fn=data_collator, batch_size=3
    )
    return model, training_step, train_dataset, data_collator, loader


_BUILT: dict[str, tuple] = {}


def _built():
    if not _BUILT:
        model, step, dataset, collator, loader = build()
        example = collator([dataset[i] for i in range(2)])
        split = graphsplit.split(step, (example,))
        _BUILT["swag"] = (model, step, dataset, collator, loader, example, split)
    return _BUILT["swag"]


def test_swag_step_verifies_on_the_example_and_another_size():
    _model, step, dataset, collator, _loader, example, split = _built()
    assert example["input_ids"].shape[:2] == (2, ENDINGS)
    assert_stage1_holds_no_trainable(split)
    other = collator([dataset[i] for i in range(2, 5)])
    assert other["input_ids"].shape[:2] == (3, ENDINGS)
    assert other["input_ids"].shape[2] != example["input_ids"].shape[2]  # dynamic padding
    for seed, batch in enumerate([example, other]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        "classifier.weight",
        "classifier.bias",
    }


def test_swag_cache_round_trip(tmp_path):
    """The script's ``DataLoader`` (batches of 3, 3 and 1 examples), cached as it is, every
    example once and in order, each batch trained exactly from its cached rows."""
    model, step, _dataset, _collator, loader, _example, split = _built()
    params = [p for p in model.parameters() if p.requires_grad]
    cached = assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
    assert len(cached) == len(SWAG["label"])


def test_swag_caches_the_frozen_bert():
    """BertForMultipleChoice runs the frozen BERT on ``input_ids.view(-1, seq)``: batch x 4
    rows. The trace finds no valid cut inside ``model`` (no dim of BERT's outputs is the
    batch's) and keeps it whole; ``path="auto"`` then compares with the module-level path,
    which caches BERT's call four rows a sample (graphsplit/calls/row_folds)."""
    *_, split = _built()
    assert split.path == "calls"
    assert "found no valid cut" in split.report()
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".bert." in name for name in held), sorted(held)
    inputs = {"input_ids", "attention_mask", "token_type_ids"}
    assert not inputs & set(split.boundary), sorted(split.boundary)


def test_swag_trace_note_names_the_folded_batch():
    """``path="trace"`` keeps ``model`` whole; its note names the (batch*4, 32) pooled output
    that has no batch dimension (it used to walk past it to BERT's call and blame its
    ``ModelOutput`` type with a ``register_codec`` fix, which would not help)."""
    _model, step, *_rest, example, _split = _built()
    split = graphsplit.split(step, (example,), path="trace")
    note = next(note for note in split.notes if note.startswith("kept model whole"))
    assert "one row per sample" in note, note
    assert "register_codec" not in note and "not a tensor" not in note, note


def test_swag_module_level_path_caches_bert_four_rows_a_sample(tmp_path):
    """``path="calls"``: BERT's call gets ``batch * 4`` rows (``input_ids.view(-1, seq)``,
    grouped: the choices of a sample are adjacent), cached a sample's four rows an entry
    (graphsplit/calls/row_folds); stage 2 holds no BERT weight and trains exactly."""
    model, step, dataset, collator, loader, example, _split = _built()
    split = graphsplit.split(step, (example,), path="calls")
    verdict = next(v for v in split.plan.verdicts if v.path == "model.bert")
    assert verdict.cached and f"{ENDINGS} rows a sample, grouped" in verdict.line()
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".bert." in name for name in held), sorted(held)
    other = collator([dataset[i] for i in range(2, 5)])
    for seed, batch in enumerate([example, other]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    params = [p for p in model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
