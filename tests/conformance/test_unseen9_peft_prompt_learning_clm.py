"""Conformance: peft prompt learning on a causal LM, as peft's notebook trains it (Bloom).

peft ``examples/causal_language_modeling/peft_prompt_tuning_clm.ipynb``: a Bloom causal LM
wrapped by ``get_peft_model`` (the base frozen, the prompt encoder trained), the notebook's own
``preprocess_function`` (``"{text_column} : {x} Label : "`` then the label's tokens and EOS,
left-padded to ``max_length`` with ``attention_mask`` 0 and labels -100 on the prompt),
``default_data_collator`` and the loop body::

    batch = {k: v.to(device) for k, v in batch.items()}
    outputs = model(**batch)
    loss = outputs.loss

Three peft configs of the same family: the notebook's ``PromptTuningConfig`` (``RANDOM`` init:
its ``TEXT`` init loads a tokenizer from the hub), and p-tuning (``PromptEncoderConfig``) with
the MLP and the LSTM reparameterisation. In each the trainable virtual tokens are concatenated
with the frozen word embeddings and run through every Bloom block, so the only frozen work a
cache can hold is the token lookup; Bloom ties ``lm_head`` to ``word_embeddings``, so stage 2
needs that weight anyway.

What must hold: the step splits exactly (loss and every prompt-encoder gradient bit for bit, on
the example and on a batch of another size), the lookup of the real tokens is cached and the
input ids are not, and a cache written through the disk trains stage 2 exactly.

Tiny config: Bloom 32 wide, 2 layers, 2 heads (dropout 0, Bloom's default); 4 virtual tokens;
a word-level tokenizer; random weights.
"""

from __future__ import annotations

import re

import pytest
import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

text_column = "Tweet text"
label_column = "text_label"
max_length = 16
VIRTUAL = 4

TWEETS = {
    "Tweet text": [
        "my order never came",
        "thanks for the quick reply",
        "the app keeps crashing again",
        "great service today",
        "still waiting for my refund",
        "love the new update",
        "nobody answers the phone",
    ],
    "Label": [0, 1, 0, 1, 0, 1, 0],
}
classes = ["complaint", "no complaint"]


def _tokenizer():
    texts = [f"{text_column} : {x} Label : " for x in TWEETS[text_column]] + classes
    words = [word for text in texts for word in re.findall(r"\w+|[^\w\s]+", text)]
    tokenizer = word_tokenizer(words, eos=None)  # Bloom's tokenizer adds no special tokens
    tokenizer.add_special_tokens({"eos_token": "</s>"})
    return tokenizer


def _train_dataset(tokenizer):
    dataset = datasets.Dataset.from_dict(TWEETS)
    dataset = dataset.map(
        lambda x: {"text_label": [classes[label] for label in x["Label"]]},
        batched=True,
        num_proc=1,
    )

    def preprocess_function(examples):  # the notebook's, verbatim
        batch_size = len(examples[text_column])
        inputs = [f"{text_column} : {x} Label : " for x in examples[text_column]]
        targets = [str(x) for x in examples[label_column]]
        model_inputs = tokenizer(inputs)
        labels = tokenizer(
            targets, add_special_tokens=False
        )  # don't add bos token because we concatenate with inputs
        for i in range(batch_size):
            sample_input_ids = model_inputs["input_ids"][i]
            label_input_ids = labels["input_ids"][i] + [tokenizer.eos_token_id]
            # print(i, sample_input_ids, label_input_ids)
            model_inputs["input_ids"][i] = sample_input_ids + label_input_ids
            labels["input_ids"][i] = [-100] * len(sample_input_ids) + label_input_ids
            model_inputs["attention_mask"][i] = [1] * len(model_inputs["input_ids"][i])
        # print(model_inputs)
        for i in range(batch_size):
            sample_input_ids = model_inputs["input_ids"][i]
            label_input_ids = labels["input_ids"][i]
            model_inputs["input_ids"][i] = [tokenizer.pad_token_id] * (
                max_length - len(sample_input_ids)
            ) + sample_input_ids
            model_inputs["attention_mask"][i] = [0] * (
                max_length - len(sample_input_ids)
            ) + model_inputs["attention_mask"][i]
            labels["input_ids"][i] = [-100] * (max_length - len(sample_input_ids)) + label_input_ids
            model_inputs["input_ids"][i] = torch.tensor(model_inputs["input_ids"][i][:max_length])
            model_inputs["attention_mask"][i] = torch.tensor(
                model_inputs["attention_mask"][i][:max_length]
            )
            labels["input_ids"][i] = torch.tensor(labels["input_ids"][i][:max_length])
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    processed_datasets = dataset.map(
        preprocess_function,
        batched=True,
        num_proc=1,
        remove_columns=dataset.column_names,
        load_from_cache_file=False,
        desc="Running tokenizer on dataset",
    )
    return processed_datasets


def _peft_config(kind: str):
    if kind == "prompt_tuning":
        return peft.PromptTuningConfig(
            task_type=peft.TaskType.CAUSAL_LM,
            prompt_tuning_init=peft.PromptTuningInit.RANDOM,
            num_virtual_tokens=VIRTUAL,
        )
    return peft.PromptEncoderConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        num_virtual_tokens=VIRTUAL,
        encoder_hidden_size=16,
        encoder_reparameterization_type="MLP" if kind == "p_tuning_mlp" else "LSTM",
    )


def build(kind: str):
    tokenizer = _tokenizer()
    train_dataset = _train_dataset(tokenizer)
    torch.manual_seed(0)
    config = transformers.BloomConfig(
        vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=2
    )
    model = transformers.BloomForCausalLM(config)
    model = peft.get_peft_model(model, _peft_config(kind))
    model.train()

    def training_step(batch):  # the notebook's loop body (device "cpu")
        batch = {k: v.to("cpu") for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs.loss
        return loss

    loader = torch.utils.data.DataLoader(
        train_dataset,
        shuffle=False,
        collate_fn=transformers.default_data_collator,
        batch_size=3,
    )
    return model, training_step, train_dataset, loader


KINDS = ["prompt_tuning", "p_tuning_mlp", "p_tuning_lstm"]
_BUILT: dict[str, tuple] = {}


def _built(kind: str):
    if kind not in _BUILT:
        model, step, dataset, loader = build(kind)
        example = transformers.default_data_collator([dataset[i] for i in range(2)])
        split = graphsplit.split(step, (example,))
        _BUILT[kind] = (model, step, dataset, loader, example, split)
    return _BUILT[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_learning_verifies_on_the_example_and_another_size(kind):
    model, step, dataset, _loader, example, split = _built(kind)
    assert example["input_ids"].shape == (2, max_length)
    assert_stage1_holds_no_trainable(split)
    other = transformers.default_data_collator([dataset[i] for i in range(2, 5)])
    for seed, batch in enumerate([example, other]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    assert expected and all("prompt_encoder" in name for name in expected)
    assert {name.split(".", 1)[1] for name in trainable} == expected


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_learning_caches_the_token_lookup(kind):
    """The frozen lookup of the real tokens is cached (``word_embeddings``, one
    ``(max_length, 32)`` row per sample) and the ids are not; the virtual tokens, their
    concatenation and every Bloom block run in stage 2."""
    *_, split = _built(kind)
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    assert per_sample.pop("model_base_model_transformer_word_embeddings") == (
        (max_length, 32),
        torch.float32,
    )
    assert "input_ids" not in per_sample
    # The labels (after the loop body's ``.to(device)``) and the attention mask with the
    # virtual tokens' ones prepended (peft's ``torch.cat``, as float).
    assert sorted(per_sample.values(), key=str) == sorted(
        [((max_length,), torch.int64), ((max_length + VIRTUAL,), torch.float32)], key=str
    )
    held = {name for name, _ in split.stage2.named_modules() if name}
    assert {"model.prompt_encoder.default", "model.base_model.transformer.h.1"} <= held


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_learning_cache_round_trip(kind, tmp_path):
    """The notebook's ``DataLoader`` (batches of 3, 3 and 1), cached as it is, every sample
    once and in order, each batch trained exactly from its cached rows."""
    model, step, _dataset, loader, _example, split = _built(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    cached = assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
    assert len(cached) == len(TWEETS["Label"])
