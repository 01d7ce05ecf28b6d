"""Padding groups keyed without the fields the loss reads only the shape of (TRL ChatML's
``prompts``): a batch then mixes samples whose such field differs, padded to the longest.

Exactness: against an unsplit trainer given the same batches (``batch_by_padded_length``), the
split run logs the same losses (``==``) and ends with bit-identical student weights. A field
whose padding moves what stage 1 stores (the teacher's input sliced by its length) stays
grouped on; a collator that pads such a field to other than the longest is refused.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import DataCollatorWithPadding

import graphsplit
from graphsplit.errors import CacheError
from graphsplit.integrations import trainer_regroup
from graphsplit.integrations.transformers import batch_by_padded_length, split_trainer
from tests.integrations.dpo import word_tokenizer
from tests.integrations.kd import (
    PaddedDistillationTrainer,
    logged_losses,
    make_trainer,
    unpadded_samples,
)

LENGTHS = [5, 5, 5, 5, 7, 7, 7, 7]
PROMPTS = [2, 3, 2, 3, 4, 2, 4, 2]  # two prompt lengths within each sequence length


class PromptCollator:
    """Pads ``input_ids`` to the batch's longest and, apart, ``prompt`` (left) to the batch's
    longest prompt; ``extra``: one more where the batch mixes prompt lengths (padding no
    sample alone predicts)."""

    def __init__(self, *, extra: bool = False) -> None:
        self.pad = DataCollatorWithPadding(word_tokenizer())
        self.extra = extra

    def __call__(self, items):
        batch = self.pad([{k: v for k, v in item.items() if k != "prompt"} for item in items])
        prompts = [item["prompt"] for item in items]
        lengths = {len(prompt) for prompt in prompts}
        width = max(lengths) + (len(lengths) - 1 if self.extra else 0)
        batch["prompt"] = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        return batch


class PromptScaledTrainer(PaddedDistillationTrainer):
    """The KD loss scaled by the batch's padded prompt length: only its shape is read."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        width = inputs.pop("prompt").shape[1]
        return super().compute_loss(model, inputs, False, num_items_in_batch) * width


class PromptSlicedTrainer(PaddedDistillationTrainer):
    """The teacher sees the last ``prompt.shape[1]`` positions: the prompt's padding moves
    what the cache stores."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        width = inputs["prompt"].shape[1]
        ids, mask = inputs["input_ids"][:, -width:], inputs["attention_mask"][:, -width:]
        with torch.no_grad():
            teacher = self.teacher(input_ids=ids, attention_mask=mask).logits
        student = model(input_ids=ids, attention_mask=mask).logits
        return F.kl_div(
            F.log_softmax(student, dim=-1),
            F.log_softmax(teacher, dim=-1),
            log_target=True,
            reduction="batchmean",
        )


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: with two, a reduction's split between threads moved the 7th digit of
    one logged loss between runs of the same trainer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _module_level_path(monkeypatch):
    """The module-level path, whose plan keeps a field read only for its shape as its shape
    (GKD's loss takes it on its own; the whole-step trace stores what it reads)."""
    monkeypatch.setattr(trainer_regroup, "split", partial(graphsplit.split, path="calls"))


def _samples():
    samples = unpadded_samples(LENGTHS)
    for sample, width in zip(samples, PROMPTS):
        sample["prompt"] = sample["input_ids"][:width]
    return samples


def _trainer(folder, kind, collator=None):
    trainer = make_trainer(
        str(folder), _samples(), per_device_train_batch_size=2, remove_unused_columns=False
    )
    trainer.__class__ = kind
    trainer.data_collator = collator or PromptCollator()
    return trainer


def _same_weights(one, other):
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.parametrize("live", [False, True], ids=["cache-first", "cache-while-training"])
def test_a_field_read_only_for_its_shape_is_not_grouped_on_and_trains_as_plain(tmp_path, live):
    plain = _trainer(tmp_path / "plain", PromptScaledTrainer)
    assert len(batch_by_padded_length(plain).groups) == 2
    plain.train()
    trainer = _trainer(tmp_path / "split", PromptScaledTrainer)
    parts = split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=live)
    trainer.train()

    assert parts.groups.shape_only == {"prompt": "prompt__shape"}
    assert sorted(parts.groups.groups.values()) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(logged_losses(trainer)) == 8  # four batches of two an epoch, two epochs
    assert logged_losses(trainer) == logged_losses(plain)
    assert _same_weights(trainer, plain)


def test_a_field_whose_padding_moves_the_cached_rows_stays_grouped_on(tmp_path):
    plain = _trainer(tmp_path / "plain", PromptSlicedTrainer)
    assert len(batch_by_padded_length(plain).groups) == 4
    plain.train()
    trainer = _trainer(tmp_path / "split", PromptSlicedTrainer)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()

    assert "prompt__shape" in parts.split.boundary  # only its shape crosses, yet it moves rows
    assert parts.groups.shape_only == {} and len(parts.groups.groups) == 4
    assert logged_losses(trainer) == logged_losses(plain)
    assert _same_weights(trainer, plain)


def test_a_collator_padding_a_shape_only_field_past_the_longest_is_refused(tmp_path):
    trainer = _trainer(tmp_path, PromptScaledTrainer, PromptCollator(extra=True))
    with pytest.raises(CacheError, match="whose values the loss never reads, the longest") as error:
        split_trainer(trainer, str(tmp_path / "cache"))
    assert "its padding depends on more than the samples themselves" in str(error.value)
    assert not (tmp_path / "cache").exists()
