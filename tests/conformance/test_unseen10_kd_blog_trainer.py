"""Conformance: the knowledge-distillation ``Trainer`` of the blog posts, through ``split_trainer``.

Upstream: philschmid/knowledge-distillation-transformers-pytorch-sagemaker, ``scripts/train.py``
(the code of the "Task-specific knowledge distillation for BERT using Transformers & Amazon
SageMaker" post, copied by many since): ``DistillationTrainingArguments`` (``alpha``,
``temperature``) and ``DistillationTrainer`` below are verbatim but for one thing:
``compute_loss`` takes ``num_items_in_batch=None``, which transformers 5's ``training_step``
passes (the post's signature raises ``TypeError`` in eager). The teacher is a
``BertForSequenceClassification``, the student a ``DistilBertForSequenceClassification`` (tiny
configs, random weights), the data tokenized sentences with an int label, padded per batch by
``DataCollatorWithPadding(tokenizer=tokenizer)`` as in the script. ``compute_loss`` asserts
that both logits have one size, calls the teacher under ``torch.no_grad()`` (with the labels:
its loss is computed and unused) and mixes the student's cross-entropy with the temperature
scaled ``KLDivLoss(reduction="batchmean")``.

Two forms:

- ``frozen teacher``: the teacher also ``requires_grad_(False)`` (the post only calls
  ``teacher.eval()``). ``split_trainer`` splits ``compute_loss``, caches the teacher's logits
  over the train dataset and ``trainer.train()`` trains stage 2 from the cache: two optimizer
  steps log the plain trainer's losses and gradient norms (given the same batches with
  ``batch_by_padded_length``) as Python floats ``==``, and end with bit-identical student
  weights. The size ``assert`` makes the whole-step trace refuse (a Python bool from two
  intermediate sizes) and the module-level path is taken; it caches the teacher's logits.
- ``as written``: the teacher's parameters keep ``requires_grad=True`` (the post's code: only
  ``eval()`` and ``torch.no_grad()``). The teacher is in no optimizer (the Trainer builds one
  over ``model`` only) and no gradient can reach it, but graphsplit counts every parameter with
  ``requires_grad`` as trainable: it refuses the teacher call under ``no_grad`` (its line
  named). Its fix line asks for ``.detach()`` instead of ``no_grad``, which would make the step
  traceable and cache nothing (the teacher still "trainable") at a higher memory cost; the fix
  that works is ``teacher.requires_grad_(False)``: see the xfail.

Tiny configs: BERT 48 wide, DistilBERT 32 wide, 2 layers each, a 11-word vocabulary.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphsplit
from graphsplit.errors import TraceError
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable, line_of

transformers = pytest.importorskip("transformers")
from transformers import DataCollatorWithPadding, Trainer, TrainingArguments  # noqa: E402

from graphsplit.integrations.transformers import (  # noqa: E402
    TrainerLoss,
    batch_by_padded_length,
    split_trainer,
)

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]
# two samples of each length: batches of 2 padded to one length are full batches
LENGTHS = [3, 3, 5, 5, 4, 4, 6, 6, 2, 2, 7, 7]


# -- upstream: scripts/train.py (num_items_in_batch added, see the docstring) ------------------
class DistillationTrainingArguments(TrainingArguments):
    def __init__(self, *args, alpha=0.5, temperature=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.alpha = alpha
        self.temperature = temperature


class DistillationTrainer(Trainer):
    def __init__(self, *args, teacher_model=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher_model
        # place teacher on same device as student
        self._move_model_to_device(self.teacher, self.model.device)
        self.teacher.eval()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # compute student output
        outputs_student = model(**inputs)
        student_loss = outputs_student.loss
        # compute teacher output
        with torch.no_grad():
            outputs_teacher = self.teacher(**inputs)

        # assert size
        assert outputs_student.logits.size() == outputs_teacher.logits.size()

        # Soften probabilities and compute distillation loss
        loss_function = nn.KLDivLoss(reduction="batchmean")
        loss_logits = loss_function(
            F.log_softmax(outputs_student.logits / self.args.temperature, dim=-1),
            F.softmax(outputs_teacher.logits / self.args.temperature, dim=-1),
        ) * (self.args.temperature**2)
        # Return weighted student loss
        loss = self.args.alpha * student_loss + (1.0 - self.args.alpha) * loss_logits
        return (loss, outputs_student) if return_outputs else loss


# -- tiny models and data ------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOKENIZER = word_tokenizer(WORDS)


def _dataset() -> list[dict]:
    """The script's ``process`` (``tokenizer(sentence, truncation=True)``) and ``labels``."""
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in LENGTHS]
    return [
        {**TOKENIZER(sentence, truncation=True, max_length=512), "labels": index % 2}
        for index, sentence in enumerate(sentences)
    ]


def _trainer(output_dir: str, *, freeze_teacher: bool) -> DistillationTrainer:
    torch.manual_seed(0)
    teacher = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=len(TOKENIZER),
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=96,
            max_position_embeddings=32,
            num_labels=2,
        )
    )
    if freeze_teacher:
        teacher.requires_grad_(False)
    student = transformers.DistilBertForSequenceClassification(
        transformers.DistilBertConfig(
            vocab_size=len(TOKENIZER),
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=32,
            num_labels=2,
        )
    )
    training_args = DistillationTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        seed=33,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        alpha=0.5,
        temperature=4.0,
    )
    return DistillationTrainer(
        student,
        training_args,
        teacher_model=teacher,
        train_dataset=_dataset(),
        data_collator=DataCollatorWithPadding(tokenizer=TOKENIZER),
        processing_class=TOKENIZER,
    )


def _logged(trainer: Trainer) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _collated(indices: list[int]) -> dict:
    data = _dataset()
    return dict(DataCollatorWithPadding(tokenizer=TOKENIZER)([data[i] for i in indices]))


# -- tests ---------------------------------------------------------------------------------------
def test_the_post_trainer_with_a_frozen_teacher_trains_from_the_cache_as_plain(tmp_path):
    plain = _trainer(str(tmp_path / "plain"), freeze_teacher=True)
    assert batch_by_padded_length(plain) is not None  # the split run's batches
    plain.train()
    trainer = _trainer(str(tmp_path / "split"), freeze_teacher=True)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()

    # two real optimizer steps: losses, gradient norms and final weights bit for bit
    assert len(_logged(trainer)) == 2
    assert _logged(trainer) == _logged(plain)
    want, got = plain.model.state_dict(), trainer.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # the teacher's logits are cached; stage 2 holds the student only
    split = parts.split
    assert "teacher" not in stage2_top_modules(split)
    cached = [key for key in split.boundary if key.startswith("teacher")]
    assert cached and all(split.boundary[key].shape[-1] == 2 for key in cached), cached
    assert len(parts.cached) == len(LENGTHS)
    assert_stage1_holds_no_trainable(split)
    # the whole-step trace refused the size assert; the module-level path took it
    report = split.report()
    assert "assert outputs_student.logits.size() == outputs_teacher.logits.size()" in report


def test_compute_loss_split_verifies_on_two_batch_sizes_and_round_trips(tmp_path):
    trainer = _trainer(str(tmp_path / "out"), freeze_teacher=True)
    loss = TrainerLoss(trainer)
    example = _collated([0, 1])
    split = graphsplit.split(loss, (example,))
    for batch in (example, _collated([2, 3]), _collated([4, 5, 6, 7][:3])):  # 2, 2, 3 samples
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)
    assert "teacher" not in stage2_top_modules(split)
    loader = [_collated([0, 1]), _collated([6, 7]), _collated([10, 11])]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)


def test_the_post_trainer_as_written_is_refused_naming_the_teacher_call(tmp_path):
    trainer = _trainer(str(tmp_path / "out"), freeze_teacher=False)
    with pytest.raises(TraceError) as info:
        split_trainer(trainer, str(tmp_path / "cache"))
    message = str(info.value)
    assert "torch.no_grad()" in message and "teacher." in message
    assert line_of(DistillationTrainer.compute_loss, "self.teacher(**inputs)") in message


def test_the_refusal_of_the_post_trainer_names_the_fix_that_caches_the_teacher(tmp_path):
    trainer = _trainer(str(tmp_path / "out"), freeze_teacher=False)
    with pytest.raises(TraceError) as info:
        split_trainer(trainer, str(tmp_path / "cache"))
    fix = str(info.value).split("fix:", 1)[1]
    assert "requires_grad_(False)" in fix, fix
