"""Conformance: ``run_summarization.py`` on a BART with ``--freeze_encoder --freeze_embeds``.

Upstream: huggingface/transformers ``examples/pytorch/summarization/run_summarization.py``
(its ``preprocess_function``, ``DataCollatorForSeq2Seq(tokenizer, model=model,
label_pad_token_id=-100, pad_to_multiple_of=None)`` and ``Seq2SeqTrainer``, whose
``compute_loss`` is ``Trainer``'s: ``model(**inputs)``, the loss BART computes from ``labels``),
with the freezing of the summarization script it replaced,
``examples/legacy/seq2seq/finetune_trainer.py``::

    if model_args.freeze_embeds:
        freeze_embeds(model)
    if model_args.freeze_encoder:
        freeze_params(model.get_encoder())
        assert_all_frozen(model.get_encoder())

``freeze_params`` / ``freeze_embeds`` / ``assert_all_frozen`` / ``grad_status`` are
``examples/legacy/seq2seq/utils.py``'s, copied verbatim below (its ``lmap`` as ``map``). For
BART ``freeze_embeds`` freezes ``model.model.shared`` (the token embedding the encoder, the
decoder and the tied ``lm_head`` share) and both stacks' learned positions: what trains is the
decoder's layers and its ``layernorm_embedding`` (and ``final_logits_bias``, a buffer).

The collator pads each batch to its longest (sources and labels), so ``split_trainer`` trains
batches of one padded length; the plain trainer is given the same batches with
``batch_by_padded_length``.

- ``no dropout`` (``dropout=attention_dropout=activation_dropout=0``): the frozen encoder's last
  hidden state and the decoder's token embedding (of ``decoder_input_ids``, which the collator
  built from the labels) are cached; stage 2 holds no encoder weight; ``trainer.train()`` after
  ``split_trainer`` logs the plain trainer's losses and grad norms and ends with its weights,
  bit for bit; ``compute_loss`` verifies on batches of 2 and 3 and a cache through the disk
  trains stage 2 exactly.
- ``--label_smoothing_factor 0.1``: ``Seq2SeqTrainer.compute_loss`` pops ``labels`` and applies
  its ``LabelSmoother`` to the logits; the encoder is still cached and the split trainer trains
  as the plain one.
- ``BART's default dropout`` (0.1): the frozen encoder is in train mode (the script never calls
  ``eval()`` on it) and draws dropout masks every step, so its output must not be cached; the
  split trainer still trains as the plain one.

Tiny config: BART 32 wide, 2 encoder and 2 decoder layers, 2 heads, 64 positions, a word-level
tokenizer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
from graphsplit.integrations.transformers import (  # noqa: E402
    TrainerLoss,
    batch_by_padded_length,
    split_trainer,
)

WORDS = [f"w{i}" for i in range(30)]
# (source words, summary words): two samples of each pair of lengths, so each padded length
# makes full batches of 2.
LENGTHS = [(6, 3), (6, 3), (9, 4), (9, 4), (5, 2), (5, 2), (11, 5), (11, 5)]


# -- upstream: examples/legacy/seq2seq/utils.py ---------------------------------------------------
def grad_status(model: nn.Module):
    return (par.requires_grad for par in model.parameters())


def freeze_params(model: nn.Module):
    """Set requires_grad=False for each of model.parameters()"""
    for par in model.parameters():
        par.requires_grad = False


def freeze_embeds(model):
    """Freeze token embeddings and positional embeddings for bart, just token embeddings for t5."""
    model_type = model.config.model_type

    if model_type in ["t5", "mt5"]:
        freeze_params(model.shared)
        for d in [model.encoder, model.decoder]:
            freeze_params(d.embed_tokens)
    elif model_type == "fsmt":
        for d in [model.model.encoder, model.model.decoder]:
            freeze_params(d.embed_positions)
            freeze_params(d.embed_tokens)
    else:
        freeze_params(model.model.shared)
        for d in [model.model.encoder, model.model.decoder]:
            freeze_params(d.embed_positions)
            freeze_params(d.embed_tokens)


def assert_all_frozen(model):
    model_grads: list[bool] = list(grad_status(model))
    n_require_grad = sum(map(int, model_grads))
    npars = len(model_grads)
    assert not any(model_grads), f"{n_require_grad / npars:.1%} of {npars} weights require grad"


# -- tiny model, tokenizer and data ----------------------------------------------------------------
@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


tokenizer = word_tokenizer(WORDS)
prefix = ""  # --source_prefix (T5's "summarize: "); none for BART
text_column, summary_column = "text", "summary"
padding = False  # --pad_to_max_length is off


def _train_dataset() -> Any:
    generator = torch.Generator().manual_seed(0)

    def words(count: int) -> str:
        return " ".join(
            WORDS[i] for i in torch.randint(0, len(WORDS), (count,), generator=generator)
        )

    raw = datasets.Dataset.from_dict(
        {
            text_column: [words(source) for source, _ in LENGTHS],
            summary_column: [words(summary) for _, summary in LENGTHS],
        }
    )
    column_names = raw.column_names

    def preprocess_function(examples):  # run_summarization.py's, verbatim
        # remove pairs where at least one record is None

        inputs, targets = [], []
        for i in range(len(examples[text_column])):
            if examples[text_column][i] and examples[summary_column][i]:
                inputs.append(examples[text_column][i])
                targets.append(examples[summary_column][i])

        inputs = [prefix + inp for inp in inputs]
        model_inputs = tokenizer(inputs, max_length=32, padding=padding, truncation=True)

        # Tokenize targets with the `text_target` keyword argument
        labels = tokenizer(text_target=targets, max_length=16, padding=padding, truncation=True)

        # If we are padding here, replace all tokenizer.pad_token_id in the labels by -100 when we
        # want to ignore padding in the loss.
        if padding == "max_length":
            labels["input_ids"] = [
                [(l if l != tokenizer.pad_token_id else -100) for l in label]  # noqa: E741
                for label in labels["input_ids"]
            ]

        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    return raw.map(preprocess_function, batched=True, remove_columns=column_names)


def _model(dropout: float) -> Any:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    model = transformers.BartForConditionalGeneration(config)
    # finetune_trainer.py: --freeze_embeds --freeze_encoder
    freeze_embeds(model)
    freeze_params(model.get_encoder())
    assert_all_frozen(model.get_encoder())
    return model


def _collator(model: Any) -> Any:
    return transformers.DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=None
    )


def _trainer(output_dir: str, dropout: float = 0.0, label_smoothing_factor: float = 0.0) -> Any:
    model = _model(dropout)
    training_args = transformers.Seq2SeqTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        seed=42,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        label_smoothing_factor=label_smoothing_factor,
    )
    return transformers.Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=_train_dataset(),
        processing_class=tokenizer,
        data_collator=_collator(model),
    )


def _logged(trainer: Any) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _train_both(tmp_path, dropout: float = 0.0, label_smoothing_factor: float = 0.0):
    plain = _trainer(str(tmp_path / "plain"), dropout, label_smoothing_factor)
    assert batch_by_padded_length(plain) is not None  # the split run's batches
    plain.train()
    trainer = _trainer(str(tmp_path / "split"), dropout, label_smoothing_factor)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    return plain, trainer, parts


def _same_weights(one: Any, other: Any) -> bool:
    a, b = one.model.state_dict(), other.model.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _encoder_weights_in_stage2(split: Any) -> set[str]:
    names = [name for name, _ in split.stage2.named_parameters()]
    return {n for n in names if "encoder.layers" in n or "encoder.embed_positions" in n}


# -- tests ---------------------------------------------------------------------------------------
def test_frozen_encoder_is_cached_and_the_trainer_trains_as_plain(tmp_path):
    plain, trainer, parts = _train_both(tmp_path)
    assert len(_logged(trainer)) == 2
    assert _logged(trainer) == _logged(plain)
    assert _same_weights(trainer, plain)

    split = parts.split
    assert_stage1_holds_no_trainable(split)
    assert not _encoder_weights_in_stage2(split), sorted(_encoder_weights_in_stage2(split))
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    encoder_out = [k for k, shape in per_sample.items() if "encoder" in k and shape[-1:] == (32,)]
    assert encoder_out, per_sample
    assert [k for k in per_sample if "decoder_embed_tokens" in k], per_sample
    assert "input_ids" not in split.boundary  # the source tokens are not stored
    assert len(parts.cached) == len(LENGTHS)


def test_compute_loss_verifies_on_two_batch_sizes_and_round_trips(tmp_path):
    trainer = _trainer(str(tmp_path / "out"))
    trainer.model.train()
    loss = TrainerLoss(trainer)
    data, collate = _train_dataset(), _collator(trainer.model)
    example = dict(collate([data[0], data[1]]))
    split = graphsplit.split(loss, (example,))
    for batch in (example, dict(collate([data[2], data[3], data[6]]))):  # 2, then 3 samples
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons), [c for c in comparisons if not c.ok]
    assert not _encoder_weights_in_stage2(split)
    loader = [dict(collate([data[i], data[i + 1]])) for i in range(0, len(data), 2)]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)


def test_frozen_encoder_with_bart_default_dropout_is_not_cached(tmp_path):
    plain, trainer, parts = _train_both(tmp_path, dropout=0.1)
    assert _logged(trainer) == _logged(plain)
    assert _same_weights(trainer, plain)
    # The encoder's dropout masks are new every step: its layers run in stage 2, from the
    # source tokens.
    assert _encoder_weights_in_stage2(parts.split)
    assert "input_ids" in parts.split.boundary


def test_label_smoothing_trains_as_plain(tmp_path):
    """``--label_smoothing_factor 0.1``: ``compute_loss`` pops ``labels`` from the batch and
    smooths over the logits itself (``LabelSmoother``); the encoder is still cached."""
    plain, trainer, parts = _train_both(tmp_path, label_smoothing_factor=0.1)
    assert trainer.label_smoother is not None
    assert _logged(trainer) == _logged(plain)
    assert _same_weights(trainer, plain)
    assert not _encoder_weights_in_stage2(parts.split)
