"""Conformance: sentence-transformers' embedding distillation (``losses.MSELoss``), in-step teacher.

sentence-transformers' ``examples/sentence_transformer/training/distillation/
model_distillation.py`` trains a small student to reproduce a frozen teacher's sentence
embeddings with ``losses.MSELoss``. A ``SentenceTransformer`` is an ``nn.Sequential`` of a
``Transformer`` module (the Hugging Face model, fed the features its ``forward`` accepts, writing
``features["token_embeddings"]``) and a ``Pooling`` module (mean pooling over the attention
mask, writing ``features["sentence_embedding"]``). The modules' ``forward`` bodies and the
loss's are copied from sentence-transformers 3.x (not installed here); the teacher's embeddings
are computed inside the step, under ``torch.no_grad()``, with the teacher in eval mode (as
``teacher.encode`` runs it), the student in train mode (BERT's dropout live).

The batch is what the data collator gives ``compute_loss``: the tokenizer's ``BatchEncoding``
(``input_ids``, ``token_type_ids``, ``attention_mask``) of a real (word-level) fast tokenizer,
padded to the longest sentence, so batches of other sizes also have other lengths.

What must hold: the step splits exactly (loss and every student gradient bit for bit, on the
example and on a batch of another size and length), the teacher's sentence embedding (one
vector a sentence) is what crosses the boundary, stage 2 does not hold the teacher, and a cache
written through the disk trains stage 2 exactly.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from torch import nn

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

WORDS = [
    "a",
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "in",
    "park",
    "big",
    "small",
    "red",
    "blue",
    "house",
    "tree",
]
SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "a big red house",
    "the small blue tree in the park",
    "a cat",
    "the dog sat on a big mat in the red house",
    "blue",
    "a small dog ran",
]
WIDTH = 32


class Transformer(nn.Module):
    """``sentence_transformers.models.Transformer`` (its ``forward``, verbatim)."""

    def __init__(self, auto_model: nn.Module) -> None:
        super().__init__()
        self.auto_model = auto_model
        self.model_forward_params = set(inspect.signature(self.auto_model.forward).parameters)

    def forward(self, features: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        trans_features = {
            key: value for key, value in features.items() if key in self.model_forward_params
        }

        outputs = self.auto_model(**trans_features, **kwargs, return_dict=True)
        token_embeddings = outputs[0]
        features["token_embeddings"] = token_embeddings

        if self.auto_model.config.output_hidden_states and "hidden_states" in outputs:
            features["all_layer_embeddings"] = outputs["hidden_states"]

        return features


class Pooling(nn.Module):
    """``sentence_transformers.models.Pooling`` with ``pooling_mode="mean"`` (its ``forward``,
    the mean branch verbatim)."""

    def __init__(self, word_embedding_dimension: int) -> None:
        super().__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_cls_token = False
        self.pooling_mode_max_tokens = False
        self.pooling_mode_mean_tokens = True
        self.pooling_mode_mean_sqrt_len_tokens = False
        self.pooling_mode_weightedmean_tokens = False
        self.pooling_mode_lasttoken = False
        self.include_prompt = True

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        token_embeddings = features["token_embeddings"]
        attention_mask = (
            features["attention_mask"]
            if "attention_mask" in features
            else torch.ones(
                token_embeddings.shape[:-1],
                device=token_embeddings.device,
                dtype=torch.int64,
            )
        )
        if not self.include_prompt and "prompt_length" in features:
            raise AssertionError("not configured here")

        ## Pooling strategy
        output_vectors = []
        if self.pooling_mode_mean_tokens or self.pooling_mode_mean_sqrt_len_tokens:
            input_mask_expanded = (
                attention_mask.unsqueeze(-1)
                .expand(token_embeddings.size())
                .to(token_embeddings.dtype)
            )
            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)

            # If tokens are weighted (by WordWeights layer), feature 'token_weights_sum' will be
            # present
            if "token_weights_sum" in features:
                sum_mask = features["token_weights_sum"].unsqueeze(-1).expand(sum_embeddings.size())
            else:
                sum_mask = input_mask_expanded.sum(1)

            sum_mask = torch.clamp(sum_mask, min=1e-9)

            if self.pooling_mode_mean_tokens:
                output_vectors.append(sum_embeddings / sum_mask)
            if self.pooling_mode_mean_sqrt_len_tokens:
                output_vectors.append(sum_embeddings / torch.sqrt(sum_mask))

        output_vector = torch.cat(output_vectors, 1)
        features["sentence_embedding"] = output_vector
        return features


class SentenceTransformer(nn.Sequential):
    """``SentenceTransformer.forward``: each module in turn on the features dict."""

    def forward(self, input: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        for module in self:
            input = module(input, **kwargs) if isinstance(module, Transformer) else module(input)
        return input


class MSELoss(nn.Module):
    """``sentence_transformers.losses.MSELoss`` (its ``forward``, verbatim)."""

    def __init__(self, model: SentenceTransformer) -> None:
        super().__init__()
        self.model = model
        self.loss_fct = nn.MSELoss()

    def forward(self, sentence_features, labels: torch.Tensor) -> torch.Tensor:
        # Concatenate multiple inputs on the batch dimension
        if len(sentence_features) > 1:
            embeddings = torch.cat(
                [self.model(inputs)["sentence_embedding"] for inputs in sentence_features], dim=0
            )

            # Repeat the labels for each input
            return self.loss_fct(embeddings, labels.repeat(len(sentence_features), 1))

        embeddings = self.model(sentence_features[0])["sentence_embedding"]
        return self.loss_fct(embeddings, labels)


def _bert(layers: int, seed: int) -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=len(WORDS) + 2,
        hidden_size=WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.BertModel(config, add_pooling_layer=False)


def build():
    teacher = SentenceTransformer(Transformer(_bert(4, seed=0)), Pooling(WIDTH))
    student = SentenceTransformer(Transformer(_bert(2, seed=1)), Pooling(WIDTH))
    teacher.eval().requires_grad_(False)  # as ``teacher.encode`` runs it
    student.train()
    train_loss = MSELoss(model=student)

    def training_step(batch):
        with torch.no_grad():
            labels = teacher(dict(batch))["sentence_embedding"]
        return train_loss([dict(batch)], labels)

    params = [p for p in student.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step, teacher=teacher, student=student, params=params
    )


TOKENIZER = word_tokenizer(WORDS, eos=None)


def _batch(indices) -> transformers.BatchEncoding:
    """The collator's batch: the tokenizer on the sentences, padded to the longest."""
    return TOKENIZER(
        [SENTENCES[i % len(SENTENCES)] for i in indices],
        padding=True,
        return_tensors="pt",
        return_token_type_ids=True,
    )


@pytest.fixture(scope="module")
def built():
    parts = build()
    example = _batch([0, 1])
    split = graphsplit.split(parts.step, (example,))
    return parts, split


def test_distillation_verifies_on_the_example_and_another_size(built):
    parts, split = built
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4, 5])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_the_teacher_sentence_embedding_is_cached_and_the_teacher_not_held(built):
    """The default path is the module-level one (the whole-step trace refuses: see below);
    the teacher's call is cached and its ``sentence_embedding`` field crosses."""
    parts, split = built
    assert split.path == "calls"
    assert "teacher" not in stage2_top_modules(split)
    assert not any(name.startswith("teacher") for name, _ in split.stage2.named_parameters())
    stage1 = {name.split(".")[0] for name, _ in split.stage1.named_parameters()}
    assert stage1 == {"teacher"}
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {f"train_loss.model.{n}" for n, _ in parts.student.named_parameters()}
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    # one WIDTH-vector a sentence for the teacher (its token states are not stored)
    assert per_sample.pop("teacher__0__sentence_embedding") == (WIDTH,)
    assert "teacher__0__token_embeddings" not in per_sample
    # the student reads the batch's three fields (dropout on its embeddings)
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert per_sample.pop(key) == (6,)
    # nothing else: the teacher's output dict echoes its input fields (see below)
    assert not per_sample


def test_the_teachers_echoed_input_fields_are_not_stored_twice(built):
    """``SentenceTransformer.forward`` returns the features dict it was given, so the
    teacher's output holds the step's own ``input_ids``, ``token_type_ids`` and
    ``attention_mask``: stage 2 answers those fields with the inputs, stored once."""
    _, split = built
    assert set(split.boundary) == {
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "teacher__0__sentence_embedding",
    }
    (planned,) = split.plan.cached.values()
    assert planned.echoed == {
        name: name for name in ("input_ids", "token_type_ids", "attention_mask")
    }
    assert (
        "not stored again, the step's own inputs it returns: input_ids (the input input_ids)"
        in (split.report())
    )


def test_the_whole_step_trace_refuses_a_module_that_writes_into_its_features_dict(built):
    """sentence-transformers' ``Transformer`` module adds ``features["token_embeddings"]`` to
    the dict it is given. The trace passes a module call's arguments as values of the graph,
    so a later read of that dict by the step would not see the write: it refuses, naming the
    module, the step's line and the path that splits it (the default one, above)."""
    parts, _ = built
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    message = str(caught.value)
    assert "The module teacher writes into the dict it is given" in message
    assert 'labels = teacher(dict(batch))["sentence_embedding"]' in message
    assert 'path="calls"' in message and "device-agnostic" not in message


def test_distillation_cache_round_trip(built, tmp_path):
    parts, split = built
    # one length a batch (padded to its longest): the cache keeps one bucket a shape
    loader = [_batch([0, 1]), _batch([2, 4]), _batch([6, 7, 3])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)
