"""Conformance: PEFT LoRA on seq2seq LMs (T5, BART), ``DataCollatorForSeq2Seq``, many lengths.

T5's relative position bias is computed in the forward from the query and key lengths
(``arange`` of each, bucketed, then the frozen ``relative_attention_bias`` embedding); BART adds
learned positions (``arange(length)`` through a frozen embedding) to its scaled embeddings.
Batches pad inputs and labels each to their longest (``DataCollatorForSeq2Seq(tokenizer,
model=model)``, which also makes ``decoder_input_ids``): six (source, target) length pairs.

T5: one plan; exact at every length and through the cache. BART: one plan too. Its
bidirectional encoder mask piece (a constant of the source length, ``and_`` of shape ``(1, 1,
L, 1)``) reads ``inputs_embeds``'s size/device off the frozen ``encoder.embed_tokens`` call,
which is not on the boundary (the boundary carries ``layernorm_embedding`` of embeds +
positions), and ``kv_length = attention_mask.shape[-1]`` off the mask moved to the device: a
plan per source length until stage 2 made those reads on boundary tensors computed from them,
checked in stage 1 (graphsplit/planning/cut/twin_reads.py), as with OPT.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("peft")

import transformers
from transformers import DataCollatorForSeq2Seq

from tests.conformance.unseen14_d_checks import (
    check_cache_and_loader,
    check_lengths,
    lora,
    signatures,
)
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

WORDS = [f"w{i}" for i in range(40)]
VOCAB = len(WORDS) + 3
PAIRS = ((9, 5), (6, 7), (11, 4), (7, 6), (13, 8), (5, 3))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _t5():
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config), ["q", "v"]


def _bart():
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(config), ["q_proj", "v_proj"]


def _batch(collator, source: int, target: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * source + target)
    rows = [
        {
            "input_ids": torch.randint(3, VOCAB, (max(2, source - 2 * i),), generator=generator),
            "labels": torch.randint(3, VOCAB, (max(2, target - i),), generator=generator),
        }
        for i in range(3)
    ]
    rows = [{k: v.tolist() for k, v in row.items()} for row in rows]
    return dict(collator(rows))


def _setup(build):
    torch.manual_seed(0)
    model, targets = build()
    model = lora(model, targets, task_type="SEQ_2_SEQ_LM")
    collator = DataCollatorForSeq2Seq(word_tokenizer(WORDS), model=model)

    def compute_loss(inputs):
        return model(**inputs).loss

    batches = [_batch(collator, source, target) for source, target in PAIRS]
    assert "decoder_input_ids" in batches[0]
    split = graphsplit.split(compute_loss, (batches[0],))
    assert split.path == "trace"
    assert_stage1_holds_no_trainable(split)
    return model, compute_loss, batches, split


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_lora_seq2seq_is_exact_at_every_length_and_through_the_cache(tmp_path, build):
    model, compute_loss, batches, split = _setup(build)
    check_lengths(split, compute_loss, batches)
    params = [p for p in model.parameters() if p.requires_grad]
    check_cache_and_loader(split, compute_loss, batches, tmp_path / "cache", params)
    if build is _t5:
        assert len(split.plans) == 1, signatures(split)


def test_lora_bart_one_plan_for_every_padded_length():
    _model, _step, batches, split = _setup(_bart)
    for batch in batches[1:]:
        split.stage1(**batch)
    assert len(split.plans) == 1, signatures(split)
