"""Conformance: a ``Trainer`` subclass distilling a NER token classifier, through ``split_trainer``.

Upstream: the data side is the Hugging Face course's token-classification chapter (chapter 7,
"Token classification": ``align_labels_with_tokens`` and ``tokenize_and_align_labels`` below,
words given pre-split with ``is_split_into_words=True``, labels aligned with ``word_ids()``,
special tokens ``-100``, a B- tag's later sub-tokens turned to I-) and
``DataCollatorForTokenClassification(tokenizer=tokenizer)`` padding each batch to its longest
(labels padded with ``-100``), as in ``huggingface/transformers``
``examples/pytorch/token-classification/run_ner.py``. The trainer is the distillation
``Trainer`` subclass of the "Task-specific knowledge distillation" post
(philschmid/knowledge-distillation-transformers-pytorch-sagemaker, ``scripts/train.py``:
``alpha``/``temperature`` arguments, the teacher under ``torch.no_grad()``,
``KLDivLoss(reduction="batchmean")`` scaled by ``temperature**2``), verbatim but for two
things: ``compute_loss`` takes ``num_items_in_batch=None`` (transformers 5 passes it), and the
post's size ``assert`` is replaced by the three lines that take the KL over the *active* tokens
only, ``logits[labels != -100]`` (a boolean-mask index: the number of rows depends on the
labels' values), the form token-level distillation needs (no named upstream NER file was found
to copy it from; the lines are this test's).

Teacher ``BertForTokenClassification`` (48 wide), student
``DistilBertForTokenClassification`` (32 wide), 2 layers each, 5 BIO tags, random weights, a
word-level tokenizer built locally. The teacher is frozen (``requires_grad_(False)``) and in
``eval()``.

Checks: ``split_trainer`` trains two optimizer steps from the cache with the plain trainer's
losses and gradient norms (``==`` on the logged floats, the plain trainer given the same batches
by ``batch_by_padded_length``) and bit-identical final weights; stage 2 holds no teacher and the
cache holds the teacher's per-token logits; ``graphsplit.split`` on ``compute_loss`` (the default
path) verifies on batches of 2 and 3 samples and round-trips a cache through disk.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    DataCollatorForTokenClassification,
    Trainer,
    TrainingArguments,
)

from graphsplit.integrations.transformers import (  # noqa: E402
    TrainerLoss,
    batch_by_padded_length,
    split_trainer,
)

WORDS = ["anna", "paris", "went", "to", "met", "bob", "in", "rome", "the", "city"]
TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
# two sentences of each length: batches of 2 padded to one length are full batches
LENGTHS = [3, 3, 5, 5, 4, 4, 6, 6, 2, 2, 7, 7]


# -- upstream: the course's preprocessing ------------------------------------------------------
def align_labels_with_tokens(labels, word_ids):
    new_labels = []
    current_word = None
    for word_id in word_ids:
        if word_id != current_word:
            # Start of a new word!
            current_word = word_id
            label = -100 if word_id is None else labels[word_id]
            new_labels.append(label)
        elif word_id is None:
            # Special token
            new_labels.append(-100)
        else:
            # Same word as previous token
            label = labels[word_id]
            # If the label is B-XXX we change it to I-XXX
            if label % 2 == 1:
                label += 1
            new_labels.append(label)

    return new_labels


def tokenize_and_align_labels(examples):
    tokenized_inputs = TOKENIZER(examples["tokens"], truncation=True, is_split_into_words=True)
    all_labels = examples["ner_tags"]
    new_labels = []
    for i, labels in enumerate(all_labels):
        word_ids = tokenized_inputs.word_ids(i)
        new_labels.append(align_labels_with_tokens(labels, word_ids))

    tokenized_inputs["labels"] = new_labels
    return tokenized_inputs


# -- upstream: the post's trainer, KL over the active (labelled) tokens -----------------------
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

        # only the tokens that carry a label (first sub-token of a word, no special/padding)
        active = inputs["labels"] != -100
        student_logits = outputs_student.logits[active]
        teacher_logits = outputs_teacher.logits[active]

        # Soften probabilities and compute distillation loss
        loss_function = nn.KLDivLoss(reduction="batchmean")
        loss_logits = loss_function(
            F.log_softmax(student_logits / self.args.temperature, dim=-1),
            F.softmax(teacher_logits / self.args.temperature, dim=-1),
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
    rng = random.Random(0)
    examples = {
        "tokens": [[rng.choice(WORDS) for _ in range(n)] for n in LENGTHS],
        "ner_tags": [[rng.randrange(len(TAGS)) for _ in range(n)] for n in LENGTHS],
    }
    tokenized = tokenize_and_align_labels(examples)
    return [
        {key: tokenized[key][index] for key in ("input_ids", "attention_mask", "labels")}
        for index in range(len(LENGTHS))
    ]


def _trainer(output_dir: str) -> DistillationTrainer:
    torch.manual_seed(0)
    teacher = transformers.BertForTokenClassification(
        transformers.BertConfig(
            vocab_size=len(TOKENIZER),
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=96,
            max_position_embeddings=32,
            num_labels=len(TAGS),
        )
    ).requires_grad_(False)
    student = transformers.DistilBertForTokenClassification(
        transformers.DistilBertConfig(
            vocab_size=len(TOKENIZER),
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=32,
            num_labels=len(TAGS),
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
        data_collator=DataCollatorForTokenClassification(tokenizer=TOKENIZER),
        processing_class=TOKENIZER,
    )


def _logged(trainer: Trainer) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _collated(indices: list[int]) -> dict:
    data = _dataset()
    return dict(DataCollatorForTokenClassification(tokenizer=TOKENIZER)([data[i] for i in indices]))


# -- tests ---------------------------------------------------------------------------------------
def test_the_labels_are_aligned_as_the_course_aligns_them():
    data = _dataset()
    # the appended </s> (a special token: word id None) is -100, and so is the collator's padding
    assert all(row["labels"][-1] == -100 for row in data)
    batch = _collated([0, 2])
    assert batch["labels"].shape == batch["input_ids"].shape
    assert (batch["labels"][0, len(data[0]["labels"]) :] == -100).all()


def test_the_ner_distillation_trainer_trains_from_the_cache_as_plain(tmp_path):
    plain = _trainer(str(tmp_path / "plain"))
    assert batch_by_padded_length(plain) is not None  # the split run's batches
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()

    # two real optimizer steps: losses, gradient norms and final weights bit for bit
    assert len(_logged(trainer)) == 2
    assert _logged(trainer) == _logged(plain)
    want, got = plain.model.state_dict(), trainer.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # the teacher's per-token logits are cached; stage 2 holds the student only
    split = parts.split
    assert "teacher" not in stage2_top_modules(split)
    cached = [key for key in split.boundary if key.startswith("teacher")]
    assert cached and all(split.boundary[key].shape[-1] == len(TAGS) for key in cached), cached
    assert len(parts.cached) == len(LENGTHS)
    assert_stage1_holds_no_trainable(split)
    # the boolean-mask index refused the whole-step trace; the module-level path took it
    report = split.report()
    assert report.startswith("graphsplit plan for forward (module-level path)")
    assert "student_logits = outputs_student.logits[active]" in report


def test_compute_loss_split_verifies_on_two_batch_sizes_and_round_trips(tmp_path):
    trainer = _trainer(str(tmp_path / "out"))
    loss = TrainerLoss(trainer)
    example = _collated([0, 1])
    split = graphsplit.split(loss, (example,))
    for batch in (example, _collated([2, 3]), _collated([4, 5, 6])):  # 2, 2, 3 samples
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)
    assert "teacher" not in stage2_top_modules(split)
    assert not any(name.startswith("teacher.") for name in split.stage2.state_dict())
    loader = [_collated([0, 1]), _collated([6, 7]), _collated([10, 11])]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)
