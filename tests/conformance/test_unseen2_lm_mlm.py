"""Conformance: ``run_mlm.py`` with a frozen embedding layer.

transformers' ``examples/pytorch/language-modeling/run_mlm.py`` batches with
``DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)``: the collator draws the
masking (before the step: the batch arrives with ``[MASK]`` ids and -100 labels) and the
Trainer calls ``model(**batch).loss``. Here ``model.bert.embeddings`` is frozen (a common
recipe for small-data fine-tuning). Left in train mode, as the Trainer leaves it, its dropout
draws: the frozen module is kept whole in stage 2 (its lookups before the dropout are not cached
either) and the report names the fix, ``.eval()``; with it, the embedding output is cached.
Tiny config, random weights, batches of 1, 2 and 3.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")

TEXTS = ["the cat sat on the mat", "a dog ran", "birds sing in the morning light", "hello"]


def _tokenizer():
    tokenizer = word_tokenizer(" ".join(TEXTS).split(), eos=None)
    tokenizer.add_special_tokens({"mask_token": "[MASK]"})
    return tokenizer


class MaskedLanguageModelling(nn.Module):
    def __init__(self, vocab: int, *, embeddings_eval: bool = False) -> None:
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            pad_token_id=0,
        )
        self.model = transformers.BertForMaskedLM(config).train()
        self.model.bert.embeddings.requires_grad_(False)
        if embeddings_eval:
            self.model.bert.embeddings.eval()

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _collated(tokenizer, rows: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    collator = transformers.DataCollatorForLanguageModeling(
        tokenizer, mlm_probability=0.5, seed=seed
    )
    batch = collator([tokenizer(TEXTS[row]) for row in rows])
    return batch["input_ids"], batch["attention_mask"], batch["labels"]


@pytest.mark.parametrize("rows", [[2], [0, 2], [0, 2, 1]], ids=["1", "2", "3"])
def test_mlm_with_a_frozen_embedding_in_train_mode_keeps_it_and_names_eval(rows):
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    step = MaskedLanguageModelling(len(tokenizer))
    batch = _collated(tokenizer, rows, seed=0)
    assert (batch[0] == tokenizer.mask_token_id).any() and (batch[2] == -100).any()
    split = split_and_verify(step, batch)
    assert set(split.boundary) == set(split.input_names)  # nothing frozen is cached
    report = split.report()
    assert "aten.bernoulli_" in report  # the frozen embedding's dropout, in stage 2
    assert "call model.bert.embeddings.eval() to make it cacheable" in report
    assert_trains_from_its_cache(step, split, [batch, _collated(tokenizer, rows, seed=1)])


@pytest.mark.parametrize("rows", [[2], [0, 2], [0, 2, 1]], ids=["1", "2", "3"])
def test_mlm_with_the_frozen_embedding_in_eval_mode_caches_its_output(rows, tmp_path):
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    step = MaskedLanguageModelling(len(tokenizer), embeddings_eval=True)
    batch = _collated(tokenizer, rows, seed=0)
    split = split_and_verify(step, batch)
    cached = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert cached.pop("model_bert_embeddings")[1:] == (32,)
    assert "model.bert.embeddings" not in stage2_paths(split)
    assert "model.bert.encoder.layer.0" in stage2_paths(split)
    batches = [batch, _collated(tokenizer, rows, seed=1)]
    assert_trains_from_its_cache(step, split, batches, tmp_path / "cache")
