"""Conformance: ``run_translation.py`` / ``run_summarization.py`` with LoRA on a T5.

transformers' ``examples/pytorch/translation/run_translation.py`` (and summarization's script,
the same loop) tokenizes ``text_target=`` labels, pads each batch with
``DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)`` (so the batch
carries ``decoder_input_ids`` from ``model.prepare_decoder_input_ids_from_labels``, and labels
padded with -100), and ``Seq2SeqTrainer`` calls ``model(**batch).loss``. Here the model is a
peft LoRA T5 (``task_type="SEQ_2_SEQ_LM"``, LoRA on every ``q``/``v``, encoder and decoder).
Only the frozen work before the first LoRA layer of each stack may be cached. The collator pads
per batch, so one cache holds batches of two lengths. Tiny config, random weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SOURCES = ["the cat sat", "a dog ran far away", "birds sing", "the sun is very bright today"]
TARGETS = ["le chat", "un chien a couru loin", "les oiseaux chantent", "le soleil"]


def _tokenizer():
    return word_tokenizer(" ".join(SOURCES + TARGETS).split())


def _lora_t5(vocab: int) -> nn.Module:
    config = transformers.T5Config(
        vocab_size=vocab,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
        dropout_rate=0.0,
    )
    model = transformers.T5ForConditionalGeneration(config).train()
    lora = peft.LoraConfig(
        task_type="SEQ_2_SEQ_LM",
        r=4,
        lora_alpha=8,
        target_modules=["q", "v"],
        init_lora_weights="gaussian",
    )
    model = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    return model


class Seq2SeqTraining(nn.Module):
    """``Seq2SeqTrainer.compute_loss``: ``model(**inputs).loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels, decoder_input_ids):
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            decoder_input_ids=decoder_input_ids,
        ).loss


def _collated(tokenizer, model, rows: list[int]) -> tuple[torch.Tensor, ...]:
    """The script's ``preprocess_function`` per example, then its collator on the batch."""
    features = []
    for row in rows:
        inputs = tokenizer(SOURCES[row], max_length=16, truncation=True)
        labels = tokenizer(text_target=TARGETS[row], max_length=16, truncation=True)
        features.append({**inputs, "labels": labels["input_ids"]})
    collator = transformers.DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=None
    )
    batch = collator(features)
    keys = ("input_ids", "attention_mask", "labels", "decoder_input_ids")
    return tuple(batch[key] for key in keys)


@pytest.mark.parametrize("rows", [[0], [0, 2], [0, 2, 1]], ids=["1", "2", "3"])
def test_seq2seq_lora_caches_the_frozen_embeddings(rows, tmp_path):
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    model = _lora_t5(len(tokenizer))
    step = Seq2SeqTraining(model)
    batch = _collated(tokenizer, model.base_model.model, rows)
    assert (batch[2] == -100).any() or len(rows) == 1  # labels padded with -100
    split = split_and_verify(step, batch)
    held = stage2_paths(split)
    base = "model.base_model.model"
    assert {f"{base}.encoder.block.0", f"{base}.decoder.block.1"} <= held
    assert f"{base}.shared" not in held  # the shared embedding's lookups are cached
    cached = {key for key in split.boundary if key not in split.input_names}
    encoder = "model_base_model_model_encoder"
    assert {f"{encoder}_embed_tokens", f"{encoder}_block_0_layer_0_layer_norm"} <= cached
    assert f"{encoder}_block_0_layer_0_self_attention_q_base_layer" in cached
    # A batch of other lengths (the collator pads per batch) through the same split and one
    # cache on disk.
    other = _collated(tokenizer, model.base_model.model, [3, 1, 2][: len(rows)])
    assert other[0].shape[1] != batch[0].shape[1]
    assert_trains_from_its_cache(step, split, [batch, other], tmp_path / "cache")
    # One plan serves both padded lengths: stage 2 builds the length-made constants itself
    # (planning/cut/sized_constants.py).
    assert len(split.plans) == 1
