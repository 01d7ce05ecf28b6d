"""Conformance: accelerate's ``nlp_example.py`` loop, ``mixed_precision="bf16"``, frozen encoder.

Upstream: huggingface/accelerate ``examples/nlp_example.py`` (``training_function``). The script
builds ``accelerator = Accelerator(mixed_precision=...)``, a ``BertForSequenceClassification``,
an ``AdamW`` optimizer, and ``tokenizer.pad(examples, padding="longest", return_tensors="pt")``
as its ``collate_fn``, then ``model, optimizer, train_dataloader = accelerator.prepare(...)`` and
runs, per batch (verbatim)::

    batch.to(accelerator.device)
    outputs = model(**batch)
    loss = outputs.loss
    loss = loss / gradient_accumulation_steps
    accelerator.backward(loss)

The user's change for a frozen encoder with a trainable head (a linear probe):
``model.bert.requires_grad_(False)``, the optimizer over the parameters that require grad, and
``model.bert.eval()`` after the script's ``model.train()`` (the frozen encoder's dropout off, as
a probe keeps it). ``mixed_precision="bf16"`` on CPU makes ``prepare`` wrap ``model.forward``
in a bfloat16 autocast (``native_amp``): the plain run computes the encoder in bfloat16.

What must hold: the loop body splits exactly against the plain prepared loop (loss and the
head's gradients bit for bit on the example and on a batch of another size), the frozen
encoder's output is cached (as the plain run computes it: bfloat16) and its weights are not in
stage 2, a cache through the disk trains exactly, and a few optimizer steps from the cache give
the plain run's losses and weights bit for bit.

Two ways a user gets there:

- Split the loop body after ``prepare`` (the step as the script runs it). Passes: the whole-step
  trace sees the autocast that ``prepare`` switched on inside ``model.forward`` and refuses, and
  ``path="auto"`` takes the module-level path, which caches ``model.bert``'s bfloat16 output.
- As docs/howto.md ("Port a diffusers training script") says: split *before*
  ``accelerator.prepare``, ``graphsplit.cache(split, loader, folder)``, then
  ``stage2, optimizer = accelerator.prepare(split.stage2, optimizer)``. This used to fail
  twice. Calling the prepared stage 2 raised ``AttributeError`` ("'Stage2' object has no
  attribute 'first'": accelerate's ``prepare_model`` rebinds ``forward.__func__`` to the
  module, and stage 2's forward was the dispatcher's bound method); graphsplit/signatures/
  dispatch.py now installs a callable object. And under ``accelerator.autocast()`` around
  split and cache, the plan's boundary dtype came from the analysis on meta (float32, autocast
  unseen) while stage 1 made bfloat16: the cache stored it upcast and the losses differed from
  the 5th decimal; graphsplit/planning/cut/ambient_dtypes.py now takes the dtypes from one run
  of stage 1 under the ambient autocast. Without the autocast the encoder is cached in float32
  (what docs/howto.md warns of; the last test).

Tiny config: BERT 16 wide, 2 layers, 2 heads, a 40-word vocabulary, 2 labels.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.data import DataLoader

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.state import AcceleratorState
from transformers import BertConfig, BertForSequenceClassification

from tests.conformance.unseen2_data_checks import (
    assert_cache_round_trip,
    assert_same_step,
)
from tests.conformance.unseen_checks import word_tokenizer

WORDS = [f"w{i}" for i in range(40)]
gradient_accumulation_steps = 1


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


def _dataset(count: int = 12) -> list[dict]:
    tokenizer = word_tokenizer(WORDS, eos=None)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        words = torch.randint(0, len(WORDS), (4 + i % 4,), generator=generator).tolist()
        encoded = tokenizer(" ".join(WORDS[w] for w in words), truncation=True, max_length=16)
        rows.append({**encoded, "labels": i % 2})
    return rows


def _script(batch_size: int = 4):
    """The script's objects: tokenizer, collate_fn, loader, model (frozen encoder), optimizer."""
    tokenizer = word_tokenizer(WORDS, eos=None)

    def collate_fn(examples):  # nlp_example.py's, off TPU
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    loader = DataLoader(_dataset(), shuffle=False, collate_fn=collate_fn, batch_size=batch_size)
    torch.manual_seed(42)
    config = BertConfig(
        vocab_size=len(WORDS) + 2,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    model.bert.requires_grad_(False)  # the frozen encoder
    optimizer = torch.optim.AdamW(
        params=[p for p in model.parameters() if p.requires_grad], lr=1e-2
    )
    return tokenizer, collate_fn, loader, model, optimizer


def _body(accelerator, model):
    """``nlp_example.py``'s loop body up to the loss (``accelerator.backward`` is the caller's)."""

    def training_step(batch):
        batch.to(accelerator.device)
        outputs = model(**batch)
        loss = outputs.loss
        loss = loss / gradient_accumulation_steps
        return loss

    return training_step


def _head(model):
    return [p for p in model.parameters() if p.requires_grad]


def _plain_run(steps: int = 3):
    """The unsplit script: prepared model, ``accelerator.backward``, the optimizer's steps."""
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    _, _, loader, model, optimizer = _script()
    model, optimizer = accelerator.prepare(model, optimizer)
    training_step = _body(accelerator, model)
    model.train()
    model.bert.eval()
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        torch.manual_seed(step)  # the head's dropout draws the same in both runs
        loss = training_step(batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    AcceleratorState._reset_state(reset_partial_state=True)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_split_after_prepare_caches_the_bf16_encoder_and_trains_as_the_plain_loop(tmp_path):
    plain_losses, plain_weights = _plain_run()

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    assert accelerator.native_amp
    _, collate_fn, loader, model, optimizer = _script()
    model, optimizer = accelerator.prepare(model, optimizer)
    assert "_original_forward" in vars(model)  # prepare wrapped the forward in its autocast
    training_step = _body(accelerator, model)
    model.train()
    model.bert.eval()

    example = next(iter(loader))
    split = graphsplit.split(training_step, (example,))
    assert split.path == "calls"  # the trace refuses the autocast prepare switched on inside
    boundary = split.boundary
    encoder = [name for name in boundary if name.startswith("model_bert")]
    assert encoder, list(boundary)
    assert all(boundary[name].dtype == torch.bfloat16 for name in encoder)  # as the plain run
    held = {name for name, _ in split.stage2.named_parameters()}
    assert held and not any("bert." in name for name in held), held

    graphsplit.verify(training_step, split, (example,))
    odd = collate_fn(_dataset()[:3])  # a batch of another size
    graphsplit.verify(training_step, split, (odd,))
    for seed, batch in enumerate([example, odd]):
        assert_same_step(
            lambda batch=batch: training_step(batch),
            lambda batch=batch: split.stage2(**split.stage1(**batch)),
            _head(model),
            seed,
        )

    assert_cache_round_trip(split, training_step, loader, tmp_path / "round", _head(model))

    # Train from the cache: the plain loop's losses and weights, bit for bit.
    graphsplit.cache(split, loader, tmp_path / "train", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "train", split)
    rows = [cached[row] for row in range(len(cached))]
    losses = []
    for step in range(len(plain_losses)):
        torch.manual_seed(step)
        loss = split.stage2(**graphsplit.collate(rows[4 * step : 4 * step + 4]))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    assert [x.item() for x in losses] == [x.item() for x in plain_losses]
    weights = model.state_dict()
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)


def _split_before_prepare(tmp_path, *, autocast):
    """docs/howto.md's order: split, cache, then ``accelerator.prepare(split.stage2, ...)``;
    with ``autocast``, split and cache under ``accelerator.autocast()`` as the docs say for a
    frozen module inside a model the script prepares."""
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    _, _, loader, model, optimizer = _script()
    training_step = _body(accelerator, model)
    model.train()
    model.bert.eval()
    example = next(iter(loader))
    with accelerator.autocast() if autocast else contextlib.nullcontext():
        split = graphsplit.split(training_step, (example,))
        graphsplit.verify(training_step, split, (example,))
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False, accelerator=accelerator)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    return accelerator, split, cached, optimizer


def _three_steps(accelerator, stage2, optimizer, cached):
    rows = [cached[row] for row in range(len(cached))]
    losses = []
    for step in range(3):
        torch.manual_seed(step)
        loss = stage2(**graphsplit.collate(rows[4 * step : 4 * step + 4]))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
    return losses


def test_docs_order_prepare_split_stage2_under_bf16(tmp_path):
    """Split and cache under ``accelerator.autocast()``, then ``prepare(split.stage2)``: the
    plain prepared loop's losses. (``prepare`` re-binds ``forward.__func__`` under mixed
    precision; stage 2's forward was the dispatcher's bound method, which then ran with the
    GraphModule as ``self``: graphsplit/signatures/dispatch.py now installs an object.)"""
    plain_losses, _ = _plain_run()
    accelerator, split, cached, optimizer = _split_before_prepare(tmp_path, autocast=True)
    assert [name for name in split.boundary if name.startswith("model_bert")]
    stage2, optimizer = accelerator.prepare(split.stage2, optimizer)
    assert _three_steps(accelerator, stage2, optimizer, cached) == [x.item() for x in plain_losses]


def test_docs_order_without_the_autocast_caches_the_encoder_in_float32(tmp_path):
    """What docs/howto.md warns of: split and cached outside the autocast, the frozen encoder
    inside the model the script prepares is cached in float32, where the prepared loop runs it
    in bfloat16 (every loss then differs from the 5th decimal)."""
    plain_losses, _ = _plain_run()
    accelerator, split, cached, optimizer = _split_before_prepare(tmp_path, autocast=False)
    encoder = [name for name in split.boundary if name.startswith("model_bert")]
    assert encoder and cached[0][encoder[0]].dtype == torch.float32
    stage2, optimizer = accelerator.prepare(split.stage2, optimizer)
    assert _three_steps(accelerator, stage2, optimizer, cached) != [x.item() for x in plain_losses]
