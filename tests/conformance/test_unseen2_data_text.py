"""Conformance: a LoRA-Llama SFT step distilled from a frozen teacher, fed as users feed it.

The step (a function of the batch, its models globals of the script) adds a KL term against a
frozen Llama teacher to the LoRA student's own causal-LM loss. Its data is a Hugging Face
``datasets.Dataset`` of texts tokenized with ``.map`` (lengths vary per sample) and batched by
transformers' collators as the scripts use them (``DataCollatorWithPadding``,
``DataCollatorForSeq2Seq``, ``DataCollatorForLanguageModeling(mlm=False)``): each pads to its
batch's longest, so batches have many lengths, and the last one is short. Also a map-style
dataset of dicts with int64 labels and bool loss masks through ``default_collate``. Each loader
goes through ``graphsplit.cache`` as it is, is read back with ``CachedDataset``, and stage 2
trains on each batch exactly as the unsplit step (loss and every gradient bit for bit).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from tests.conformance.unseen2_data_checks import (
    assert_cache_round_trip,
    kd_teacher_and_lora_student,
)
from tests.conformance.unseen_checks import word_tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

WORDS = [
    *("the", "a", "cat", "dog", "sat", "ran", "on", "under"),
    *("mat", "rug", "red", "blue", "big", "small", "and", "then"),
]
TEXTS = [
    "the cat sat on the mat",
    "a dog ran",
    "the big red dog sat under a blue rug and then ran",
    "a small cat",
    "the dog and the cat sat on the rug",
    "red mat",
    "a big blue cat ran on the mat then sat",
]


teacher, student = kd_teacher_and_lora_student()
PARAMS = [param for param in student.parameters() if param.requires_grad]
tokenizer = word_tokenizer(WORDS)


def training_step(batch):  # a KD + SFT loop body
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    labels = (
        batch["labels"] if "labels" in batch else input_ids.masked_fill(attention_mask == 0, -100)
    )
    if "loss_mask" in batch:  # train on the completion only
        labels = labels.masked_fill(~batch["loss_mask"], -100)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits
    outputs = student(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    kd = F.kl_div(
        F.log_softmax(outputs.logits, dim=-1),
        F.softmax(teacher_logits / 2.0, dim=-1),
        reduction="batchmean",
    )
    return outputs.loss + 0.5 * kd


def _tokenized(with_labels: bool):
    table = datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))})

    def tokenize_function(examples):
        tokens = tokenizer(examples["text"])
        if with_labels:
            tokens["labels"] = [list(ids) for ids in tokens["input_ids"]]
        return tokens

    return table.map(tokenize_function, batched=True, remove_columns=["text", "id"])


COLLATORS = {
    "with_padding": lambda: (_tokenized(False), transformers.DataCollatorWithPadding(tokenizer)),
    "seq2seq": lambda: (
        _tokenized(True),
        transformers.DataCollatorForSeq2Seq(tokenizer, padding="longest"),
    ),
    "language_modeling": lambda: (
        _tokenized(False),
        transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    ),
}


@pytest.mark.parametrize("collator", sorted(COLLATORS))
def test_hf_dataset_padded_to_each_batch_s_longest(collator, tmp_path):
    """7 texts at batch 3: batches of 3, 3 and 1, each padded to its own longest."""
    dataset, collate_fn = COLLATORS[collator]()
    loader = DataLoader(dataset, batch_size=3, collate_fn=collate_fn)
    batches = list(loader)
    assert [len(batch["input_ids"]) for batch in batches] == [3, 3, 1]
    lengths = [batch["input_ids"].shape[1] for batch in batches]
    assert len(set(lengths)) == 3, lengths
    if collator != "with_padding":
        assert (batches[0]["labels"] == -100).any()
    split = graphsplit.split(training_step, (dict(batches[0]),))
    assert all(c.ok for c in graphsplit.verify(training_step, split, (dict(batches[0]),)))
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)
    assert 1 <= len(split.plans) <= 3


class Records(torch.utils.data.Dataset):
    """A user's map-style dataset of dicts: int64 ids and labels, bool masks, an int class.

    ``bool_attention`` gives the attention mask as bool too (else int64, as tokenizers do);
    ``loss_mask`` (bool, the completion's tokens) is read by the step.
    """

    def __init__(self, length: int, tokens: int = 8, *, bool_attention: bool = False) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 64, (length, tokens), generator=generator)
        self.lengths = torch.randint(3, tokens + 1, (length,), generator=generator)
        self.bool_attention = bool_attention

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        mask = torch.arange(self.ids.shape[1]) < self.lengths[index]
        return {
            "key": f"record-{index}",
            "input_ids": self.ids[index].masked_fill(~mask, 0),
            "attention_mask": mask if self.bool_attention else mask.long(),
            "loss_mask": mask & (torch.arange(self.ids.shape[1]) >= 2),  # bool
            "labels": self.ids[index].masked_fill(~mask, -100),  # int64
            "category": index % 3,
        }


def _dict_round_trip(dataset, folder) -> graphsplit.Split:
    loader = DataLoader(dataset, batch_size=2)
    first = next(iter(loader))
    assert first["loss_mask"].dtype == torch.bool and first["labels"].dtype == torch.int64
    split = graphsplit.split(training_step, (first,))
    assert all(c.ok for c in graphsplit.verify(training_step, split, (first,)))
    keys = [f"record-{index}" for index in range(len(dataset))]
    assert_cache_round_trip(split, training_step, loader, folder, PARAMS, expected_keys=keys)
    return split


def test_dicts_with_int64_labels_and_bool_masks(tmp_path):
    split = _dict_round_trip(Records(5), tmp_path / "cache")
    assert split.path == "trace"


def test_dicts_with_a_bool_attention_mask_and_keys(tmp_path):
    """A bool attention mask makes transformers' masking_utils read the mask's values, so the
    step takes the module-level path, where the batch's ``"key"`` list is an input of the step:
    it crosses as ``key__text`` and comes back as the same strings, and every cached item keeps
    its own sample key."""
    split = _dict_round_trip(Records(5, bool_attention=True), tmp_path / "cache")
    assert split.path == "calls"
    assert "key__text" in split.boundary and "key" not in split.boundary
