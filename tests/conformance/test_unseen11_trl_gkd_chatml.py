"""Conformance: TRL's ``GKDTrainer`` as its docs run it: a ``messages`` dataset, TRL's own collator.

Upstream: ``trl/experimental/gkd/gkd_trainer.py`` (TRL 1.16, run unmodified: its
``compute_loss`` calls the student, then ``self.teacher_model`` under ``torch.no_grad()`` in
``eval()`` mode, and ``generalized_jsd_loss`` masks ``jsd[labels != -100]``; its
``training_step`` draws ``random.random() <= self.lmbda`` every step), called as its
docstring documents it (``GKDTrainer(model=..., teacher_model=..., args=GKDConfig(...),
processing_class=tokenizer, train_dataset=...)`` over a conversational ``messages`` dataset, no
``data_collator``: "It defaults to a DataCollatorForChatML using the processing_class").
``lmbda=0`` and ``seq_kd=False`` (off-policy: the
teacher sees the dataset's sequences, as the docs allow), ``beta=0.5``.

What differs from ``tests/integrations/test_trl_gkd.py`` (pre-padded ids,
``default_data_collator``): the batches come from TRL's default ``DataCollatorForChatML``, which
applies the tokenizer's chat template, **left**-pads ``input_ids`` / ``labels`` to the batch's
longest sequence and, separately, ``prompts`` / ``prompt_attention_mask`` to the batch's longest
prompt, and adds a ``byte_offsets`` tensor. The conversations are chosen so that samples of one
total length have prompts of different lengths. GKD's loss reads only ``prompts.shape[1]`` (the
plan keeps ``prompts__shape``), so ``split_trainer`` groups samples by sequence length alone
(:mod:`graphsplit.integrations.trainer_regroup`): a batch mixes prompt lengths, padded to the
longest as the plain collator pads them, and trains as the plain trainer bit for bit.

The teacher is frozen as graphsplit's refusal asks (``requires_grad_(False)``,
``config.use_cache = False``). Student and teacher: ``Qwen2ForCausalLM``, 2 layers, hidden 32
and 48, vocab 128, random weights; the tokenizer is word-level with a ChatML-like template,
built locally.
"""

from __future__ import annotations

import random

import pytest
import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import stage2_top_modules
from tests.helpers import assert_stage1_holds_no_trainable

pytest.importorskip("trl")
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl.experimental.gkd import GKDConfig, GKDTrainer

from graphsplit.integrations.transformers import (
    TrainerLoss,
    batch_by_padded_length,
    split_trainer,
)

VOCAB = 128
WORDS = [f"w{i}" for i in range(40)]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }}"
    " <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# (prompt words, answer words): two conversations of each total length, prompts differing
SHAPES = [(2, 4), (4, 2), (3, 3), (1, 5), (2, 2), (3, 1), (5, 3), (2, 6), (1, 2), (2, 1)]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
    vocab = {token: index for index, token in enumerate([*specials, *WORDS])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def conversations() -> Dataset:
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": words(prompt)},
                    {"role": "assistant", "content": words(answer)},
                ]
            }
            for prompt, answer in SHAPES
        ]
    )


def tiny_qwen2(seed: int, hidden: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=2,
        )
    )


def make_trainer(output_dir: str, **arguments) -> GKDTrainer:
    training_args = GKDConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=arguments.pop("max_steps", 3),
        logging_steps=1,
        seed=11,
        lmbda=0.0,
        beta=0.5,
        max_length=64,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        **arguments,
    )
    trainer = GKDTrainer(
        model=tiny_qwen2(1, 32),
        teacher_model=tiny_qwen2(2, 48),
        args=training_args,
        processing_class=chat_tokenizer(),
        train_dataset=conversations(),
    )
    # the fix graphsplit's refusal names for GKD's teacher
    trainer.teacher_model.requires_grad_(False)
    trainer.teacher_model.config.use_cache = False
    return trainer


def _logged(trainer) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _collated(trainer, indices: list[int]) -> dict:
    rows = [trainer.train_dataset[i] for i in indices]
    return dict(trainer.data_collator(rows))


def _same_weights(one, other) -> bool:
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


# -- tests ---------------------------------------------------------------------------------------
def test_the_chatml_collator_left_pads_sequences_and_prompts_separately(tmp_path):
    trainer = make_trainer(str(tmp_path))
    batch = _collated(trainer, [0, 1])  # one total length, prompts of 2 and 4 words
    assert batch["input_ids"].shape[1] != batch["prompts"].shape[1]
    assert batch["prompt_attention_mask"][0, 0] == 0  # the shorter prompt is left-padded
    assert batch["labels"].shape == batch["input_ids"].shape
    assert set(batch) >= {"input_ids", "labels", "prompts", "prompt_attention_mask", "byte_offsets"}


def test_off_policy_gkd_trains_from_the_cache_as_plain(tmp_path):
    plain = make_trainer(str(tmp_path / "plain"))
    batch_by_padded_length(plain)  # the split run's batches
    plain.train()
    trainer = make_trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    calls = []
    trainer.teacher_model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    trainer.train()

    assert len(_logged(trainer)) == 3
    assert _logged(trainer) == _logged(plain)
    assert _same_weights(trainer, plain)
    assert not calls  # the teacher never ran while training

    split = parts.split
    assert "teacher_model" not in stage2_top_modules(split)
    assert not any(key.startswith("teacher_model.") for key in split.stage2.state_dict())
    cached = [key for key in split.boundary if key.startswith("teacher_model")]
    assert cached and all(split.boundary[key].shape[-1] == VOCAB for key in cached), cached
    keys = [parts.cached[row]["key"] for row in range(len(parts.cached))]
    assert sorted(key for key in keys if "~" not in key) == sorted(map(str, range(len(SHAPES))))
    assert_stage1_holds_no_trainable(split)
    assert split.report().startswith("graphsplit plan for forward (module-level path)")


def test_padding_groups_follow_the_sequence_length_the_loss_reads(tmp_path):
    trainer = make_trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    by_length = {}
    for index in range(len(SHAPES)):
        length = _collated(trainer, [index])["input_ids"].shape[1]
        by_length.setdefault(length, []).append(index)
    # one group per sequence length (prompts of several lengths in each), no fillers cached
    assert sorted(parts.groups.groups.values()) == sorted(by_length.values())
    assert set(parts.groups.shape_only) == {"prompts", "prompt_attention_mask", "byte_offsets"}
    assert len(parts.cached) == len(SHAPES)


def test_batches_mixing_prompt_lengths_train_as_plain_over_two_epochs(tmp_path):
    plain = make_trainer(str(tmp_path / "plain"), max_steps=10)
    batch_by_padded_length(plain)
    prompts = []
    plain.compute_loss = _recording(plain.compute_loss, prompts)
    plain.train()
    trainer = make_trainer(str(tmp_path / "split"), max_steps=10)
    split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()

    assert len(_logged(trainer)) == 10  # five batches of two an epoch
    assert _logged(trainer) == _logged(plain)
    assert _same_weights(trainer, plain)
    # the plain batches pad prompts to the longer of two different prompt lengths
    assert any(len(set(lengths)) > 1 for lengths in prompts)


def _recording(compute_loss, prompts: list):
    def recorded(model, inputs, *args, **kwargs):
        mask = inputs["prompt_attention_mask"]
        prompts.append(tuple(mask.sum(dim=1).tolist()))
        return compute_loss(model, inputs, *args, **kwargs)

    return recorded


def test_compute_loss_split_verifies_on_two_batch_sizes_and_round_trips(tmp_path):
    trainer = make_trainer(str(tmp_path / "out"))
    loss = TrainerLoss(trainer)
    example = _collated(trainer, [0, 1])
    split = graphsplit.split(loss, (example,))
    for batch in (example, _collated(trainer, [2, 3]), _collated(trainer, [6, 7, 4])):
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)
    assert "teacher_model" not in stage2_top_modules(split)
    loader = [_collated(trainer, [0, 1]), _collated(trainer, [2, 3]), _collated(trainer, [4, 5])]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)
