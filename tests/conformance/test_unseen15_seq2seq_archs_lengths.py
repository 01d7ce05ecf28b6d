"""Conformance: PEFT LoRA on more encoder-decoder LMs, and Whisper, over many padded lengths.

The form of test_unseen14_seq2seq_lengths.py (T5, BART) on Pegasus (sinusoidal positions),
mBART, Marian (sinusoidal), M2M100 (sinusoidal, made from the ids), Blenderbot-small and PLBart:
tiny configs, random weights, LoRA on ``q_proj`` / ``v_proj`` (``SEQ_2_SEQ_LM``), the Trainer's
``model(**inputs).loss`` on batches ``DataCollatorForSeq2Seq`` pads to their longest. Split at
one (source, target) length pair, ``verify`` bit for bit at all six, the plans counted after
stage 1 ran at every pair, then the six batches cached and trained from ``cached.loader``.

- mBART, PLBart, Blenderbot-small, M2M100 (``layerdrop=0``): one plan, exact, cache exact. The
  encoder mask piece reads ``inputs_embeds``'s size/device off the frozen ``embed_tokens`` call
  (not on the boundary) and ``attention_mask.shape[-1]``: stage 2 reads them off a boundary
  twin, checked in stage 1 (planning/cut/twin_reads.py).
- Pegasus, Marian: a plan per source length, by design, exact and cached. Their sinusoidal
  table (a frozen ``nn.Embedding``) is called as ``embed_positions(inputs_embeds.shape[:-1])``,
  a ``torch.Size``, and slices itself to the length inside: a per-dataset constant of the
  length read through a frozen module, stored per plan as GPT-2's positions are. It used to be
  one plan whose constant no size guard held (``rules/constant_sizes.size_values_read`` looked
  for an *int* read off a size, and the only size nodes were ``torch.Size`` values), so
  ``verify`` passed but ``cache()`` stopped at the second length ("the per-dataset constant
  'embed_pos' differs between batches of one plan"). Now the entries of a ``torch.Size`` read
  whole are guarded, the batch size's entry left out.
  ``test_frozen_table_called_on_a_size_caches`` is the minimal case.
- M2M100 as configured by default (``encoder_layerdrop=decoder_layerdrop=0.05``): LayerDrop
  draws ``torch.rand([])`` and branches on it in Python; the whole-step trace refuses (rightly)
  and the module-level path caches the embeddings: exact at every length.
- Whisper (fixed ``input_features``, labels of six padded lengths from the upstream
  ``DataCollatorSpeechSeq2SeqWithPadding``): ``freeze_encoder()`` (decoder trained whole) and
  LoRA on the decoder's q/v only. One plan each: the label length reaches only checks whose
  value is the same at every length >= 2 (``labels.shape[1] > 32``, sdpa's ``q_length > 1``);
  with the decoder LoRA the frozen position rows sliced to the length are summed into the
  per-sample embeddings (the boundary's ``dropout``), no per-dataset constant of the length.
  Exact at every length and through the cache, trained from ``cached.loader`` at stage 1's
  batch size (see ``_cache_and_loader_by_labels`` for why not 2). PEFT's ``SEQ_2_SEQ_LM``
  wrapper fails on Whisper eagerly ("WhisperDecoder got multiple values for keyword argument
  'input_ids'"), so that LoRA is a plain ``PeftModel`` (task type unset), as PEFT's Whisper
  guide does.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("peft")

import transformers
from transformers import DataCollatorForSeq2Seq

from tests.conformance.unseen2_data_checks import assert_cache_round_trip, assert_same_step
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
TARGETS = (5, 7, 4, 6, 8, 3)  # Whisper's transcript lengths (labels one longer: eos)
COMMON = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
}
ARCHS = {
    "pegasus": (transformers.PegasusForConditionalGeneration, transformers.PegasusConfig),
    "mbart": (transformers.MBartForConditionalGeneration, transformers.MBartConfig),
    "marian": (transformers.MarianMTModel, transformers.MarianConfig),
    "m2m100": (transformers.M2M100ForConditionalGeneration, transformers.M2M100Config),
    "blenderbot_small": (
        transformers.BlenderbotSmallForConditionalGeneration,
        transformers.BlenderbotSmallConfig,
    ),
    "plbart": (transformers.PLBartForConditionalGeneration, transformers.PLBartConfig),
}
NO_LAYERDROP = {"encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0}
# The size/device reads stage 2 makes on a boundary twin (the mask's), checked in stage 1.
TWIN_READS = {"mbart", "m2m100", "blenderbot_small", "plbart"}
# A frozen sinusoidal table called on inputs_embeds.shape[:-1]: a plan per source length.
SIZED_TABLE = {"pegasus", "marian"}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _setup(name: str, **config: Any):
    torch.manual_seed(0)
    model_class, config_class = ARCHS[name]
    model = model_class(config_class(**COMMON, **config))
    model = lora(model, ["q_proj", "v_proj"], task_type="SEQ_2_SEQ_LM")
    collator = DataCollatorForSeq2Seq(word_tokenizer(WORDS), model=model)

    def compute_loss(inputs):
        return model(**inputs).loss

    batches = [_batch(collator, source, target) for source, target in PAIRS]
    split = graphsplit.split(compute_loss, (batches[0],))
    return model, compute_loss, batches, split


def _plans_after_stage1(split, batches) -> int:
    for batch in batches:
        split.stage1(**batch)
    return len(split.plans)


def _plans_expected(name: str) -> int:
    return len({source for source, _ in PAIRS}) if name in SIZED_TABLE else 1


def _config(name: str) -> dict[str, Any]:
    return NO_LAYERDROP if name == "m2m100" else {}


@pytest.mark.parametrize("name", list(ARCHS))
def test_lora_seq2seq_is_exact_with_its_plans_at_every_length(name):
    _model, compute_loss, batches, split = _setup(name, **_config(name))
    assert split.path == "trace"
    assert_stage1_holds_no_trainable(split)
    check_lengths(split, compute_loss, batches)
    # One plan: the lengths flow into the mask and positions only, which stage 2 recomputes
    # (Pegasus and Marian: a plan per source length, their positions a frozen table's slice).
    assert _plans_after_stage1(split, batches) == _plans_expected(name), signatures(split)
    assert ("check_same_read" in split.stage1.code) == (name in TWIN_READS)


@pytest.mark.parametrize("name", list(ARCHS))
def test_lora_seq2seq_is_exact_through_the_cache(tmp_path, name):
    model, compute_loss, batches, split = _setup(name, **_config(name))
    params = [p for p in model.parameters() if p.requires_grad]
    check_cache_and_loader(split, compute_loss, batches, tmp_path / "cache", params)
    assert len(split.plans) == _plans_expected(name), signatures(split)


def test_m2m100_layerdrop_takes_the_module_level_path_exactly():
    """M2M100's default LayerDrop branches on ``torch.rand([])`` in Python: the trace refuses
    (a random draw deciding control flow) and the module-level path is exact at every length.
    (Its cache round trip is not run here: a dropped layer's LoRA weights get no gradient, on
    both sides, which assert_same_step's ``torch.equal(None, None)`` cannot compare.)"""
    _model, compute_loss, batches, split = _setup("m2m100")
    assert split.path == "calls"
    assert "layerdrop" in split.report()
    check_lengths(split, compute_loss, batches)


# -- Whisper ----------------------------------------------------------------------------------
# upstream: run_speech_recognition_seq2seq.py's collator (as in test_unseen10_whisper_...)
@dataclass
class DataCollatorSpeechSeq2SeqWithPadding:
    processor: Any
    decoder_start_token_id: int
    forward_attention_mask: bool

    def __call__(self, features):
        model_input_name = self.processor.model_input_names[0]
        input_features = [{model_input_name: feature[model_input_name]} for feature in features]
        label_features = [{"input_ids": feature["labels"]} for feature in features]
        batch = self.processor.feature_extractor.pad(input_features, return_tensors="pt")
        if self.forward_attention_mask:
            batch["attention_mask"] = torch.LongTensor(
                [feature["attention_mask"] for feature in features]
            )
        labels_batch = self.processor.tokenizer.pad(label_features, return_tensors="pt")
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        return batch


def _whisper(mode: str):
    tokenizer = word_tokenizer(WORDS)
    extractor = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1)
    processor = transformers.WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(
            vocab_size=len(tokenizer),
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
        )
    )
    if mode == "freeze_encoder":
        model.freeze_encoder()
    else:  # LoRA on the decoder's attention only; PeftModelForSeq2SeqLM fails on Whisper
        targets = [
            f"model.decoder.layers.{i}.{attention}.{projection}"
            for i in range(2)
            for attention in ("self_attn", "encoder_attn")
            for projection in ("q_proj", "v_proj")
        ]
        model = lora(model, targets, task_type=None)
    collator = DataCollatorSpeechSeq2SeqWithPadding(processor, 2, forward_attention_mask=False)
    batches = []
    for target in TARGETS:
        rng = np.random.default_rng(target)
        rows = []
        for i in range(3):
            audio = rng.standard_normal(int(16000 * (0.3 + 0.2 * i))).astype(np.float32)
            features = extractor(audio, sampling_rate=16000).input_features[0]
            words = [WORDS[(7 * target + 3 * j + i) % len(WORDS)] for j in range(target - i)]
            rows.append(
                {"input_features": features, "labels": tokenizer(" ".join(words)).input_ids}
            )
        batches.append(dict(collator(rows)))
    return model, batches


def _cache_and_loader_by_labels(split, step, batches, folder: Path, params) -> None:
    """check_cache_and_loader keyed on ``labels`` (Whisper's batches have no ``input_ids``), at
    stage 1's batch size. With ``batch_size=2`` each bucket of 3 rows ends in a batch of 1, and
    the eager encoder on one row alone differs from that row of its batch of 3 (up to 4.8e-7;
    plain torch, no graphsplit involved): the loss / a gradient differed in the last bits there
    (seed 3, both variants), as docs/howto.md says of a bucket's shorter last batch."""
    lengths = [batch["labels"].shape[1] for batch in batches]
    assert len(set(lengths)) == len(lengths), "one batch per padded length"
    cached = assert_cache_round_trip(split, step, list(batches), folder, params)
    where = {}
    for index, batch in enumerate(batches):
        for row in range(batch["labels"].shape[0]):
            where[str(len(where))] = (index, row)
    loader = cached.loader(batch_size=3, seed=0)
    loader.set_epoch(0)
    indices = loader.batch_sampler.epoch_batches(0)
    seen = []
    for seed, (rows, batch_indices) in enumerate(zip(loader, indices, strict=True)):
        keys = [str(cached[index]["key"]) for index in batch_indices]
        (index,) = {where[key][0] for key in keys}  # one length: one raw batch, its 3 rows
        picks = torch.tensor([where[key][1] for key in keys])
        eager = {k: v[picks] for k, v in batches[index].items()}
        assert_same_step(
            lambda eager=eager: step(eager), lambda rows=rows: split.stage2(**rows), params, seed
        )
        seen.extend(keys)
    assert sorted(seen) == sorted(where)


@pytest.mark.parametrize("mode", ["freeze_encoder", "decoder_lora"])
def test_whisper_labels_of_every_padded_length(tmp_path, mode):
    model, batches = _whisper(mode)
    assert {batch["input_features"].shape for batch in batches} == {(3, 16, 100)}

    def compute_loss(inputs):
        return model(**inputs).loss

    split = graphsplit.split(compute_loss, (batches[0],))
    assert split.path == "trace"
    assert_stage1_holds_no_trainable(split)
    assert "input_features" not in split.boundary  # the frozen encoder's output is cached
    check_lengths(split, compute_loss, batches)
    # One plan: the label length is guarded only as a range (labels.shape[1] > 32 = false).
    assert _plans_after_stage1(split, batches) == 1, signatures(split)
    params = [p for p in model.parameters() if p.requires_grad]
    _cache_and_loader_by_labels(split, compute_loss, batches, tmp_path / "cache", params)


# -- the minimal case of the Pegasus / Marian refusal -------------------------------------------
class _Positions(nn.Embedding):
    """PegasusSinusoidalPositionalEmbedding, reduced: called on a shape, slices itself."""

    def forward(self, shape):
        seq_len = shape[1] if isinstance(shape, torch.Size) else shape
        return super().forward(torch.arange(seq_len, device=self.weight.device))


class _Encoder(nn.Module):
    def __init__(self, pass_int: bool):
        super().__init__()
        self.pass_int = pass_int
        self.tokens = nn.Embedding(20, 8).requires_grad_(False)
        self.positions = _Positions(64, 8).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, ids, attention_mask):
        x = self.tokens(ids) * 2.0
        positions = self.positions(x.shape[1] if self.pass_int else x.shape[:-1])
        h = nn.functional.dropout(x + positions, 0.1, training=True)
        b, n = x.shape[0], x.shape[1]  # a per-sample mask of x's size: x is on the boundary
        keep = attention_mask.to(x.device, torch.bool)[:, None, :].expand(b, n, n)
        return (self.head(h) * keep).mean()


@pytest.mark.parametrize("pass_int", [False, True], ids=["size", "int"])
def test_frozen_table_called_on_a_size_caches(pass_int):
    torch.manual_seed(0)
    step = _Encoder(pass_int)
    batches = [
        {"ids": torch.randint(0, 20, (2, n)), "attention_mask": torch.ones(2, n, dtype=torch.long)}
        for n in (5, 7)
    ]
    split = graphsplit.split(step, (), batches[0])
    with tempfile.TemporaryDirectory() as folder:
        graphsplit.cache(split, batches, folder, progress=False)
    assert len(split.plans) == 2, signatures(split)
