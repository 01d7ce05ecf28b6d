"""Conformance: ``run_clm.py``, a PEFT LoRA, ``gradient_checkpointing`` and ``bf16``, split_trainer.

Upstream: huggingface/transformers ``examples/pytorch/language-modeling/run_clm.py``. The
script tokenizes a text column, concatenates and chunks it with its ``group_texts`` (copied
verbatim below: blocks of ``block_size`` tokens, ``labels`` a copy of ``input_ids``), and trains
with the stock ``Trainer`` (no ``compute_loss`` override) and ``default_data_collator``. The
user's LoRA edit is PEFT's documented one, ``model = get_peft_model(model, LoraConfig(r=4,
lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))``,
and the run is configured as people run it on a GPU: ``--bf16 --gradient_checkpointing``
(``TrainingArguments(bf16=True, gradient_checkpointing=True)``; here ``use_cpu=True``, where
accelerate's bf16 autocast is native on CPU). ``train()`` then enables checkpointing on the
PEFT model and has accelerate wrap its ``forward`` in a bfloat16 autocast.

What must hold: ``split_trainer(trainer, folder)`` then ``trainer.train()`` logs the plain
trainer's losses and grad norms and ends with its weights, bit for bit; the frozen work below
the first LoRA (the token embedding, layer 0's norm and frozen ``k_proj``, and the LoRA'd
projections' frozen base layers) is cached in the dtype the plain run computes it in
(bfloat16 for the linears under the autocast); stage 2 holds no ``embed_tokens`` weight;
``compute_loss`` (``TrainerLoss``) under the trainer's forward wrapping verifies on batches of
two sizes; the cache read back from disk holds one row per block. (``split_trainer`` used to
plan before ``train()`` switched checkpointing on: layer 0's cached calls were recomputed in
backward outside stage 2's answers, a ``CheckpointError``. It now enables checkpointing as
``train()`` will first: graphsplit/integrations/trainer_loss.py ``checkpointing_as_train``.)

Tiny config: Llama 32 wide, 2 layers, 2 heads (1 KV head), a 40-word word-level tokenizer,
blocks of 8 tokens.
"""

from __future__ import annotations

from itertools import chain

import pytest
import torch

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("peft")

from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from graphsplit.integrations.trainer_loss import TrainerLoss, prepared_forward
from graphsplit.integrations.transformers import split_trainer
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import tiny_llama_config

WORDS = [f"w{i}" for i in range(40)]
block_size = 8


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


def _lm_dataset() -> Dataset:
    tokenizer = word_tokenizer(WORDS)
    generator = torch.Generator().manual_seed(0)
    texts = [
        " ".join(WORDS[w] for w in torch.randint(0, 40, (5 + i % 7,), generator=generator))
        for i in range(24)
    ]
    raw_datasets = Dataset.from_dict({"text": texts})
    column_names = list(raw_datasets.features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    tokenized_datasets = raw_datasets.map(
        tokenize_function, batched=True, remove_columns=column_names
    )

    # Main data processing function that will concatenate all texts from our dataset and
    # generate chunks of block_size. (run_clm.py's, verbatim)
    def group_texts(examples):
        # Concatenate all texts.
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}  # noqa: SIM118
        total_length = len(concatenated_examples[list(examples.keys())[0]])  # noqa: RUF015
        # We drop the small remainder, we could add padding if the model supported it instead
        # of this drop, you can customize this part to your needs.
        if total_length >= block_size:
            total_length = (total_length // block_size) * block_size
        # Split by chunks of max_len.
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized_datasets.map(group_texts, batched=True)
    train_dataset = lm_datasets
    max_train_samples = 24  # the script's --max_train_samples: full batches of 4
    train_dataset = train_dataset.select(range(max_train_samples))
    return train_dataset


def _trainer(output_dir: str) -> Trainer:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(WORDS) + 3))
    peft_config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config)
    with torch.no_grad():  # LoRA B starts at zero; move it so the adapters' gradients all flow
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-2,
        logging_steps=1,
        seed=3,
        bf16=True,
        gradient_checkpointing=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    return Trainer(
        model=model,
        args=training_args,
        train_dataset=_lm_dataset(),
        data_collator=default_data_collator,
    )


def _logged(trainer, *keys):
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


def _train_both(tmp_path, before_split=None):
    plain = _trainer(str(tmp_path / "plain"))
    assert len(plain.train_dataset) % 4 == 0  # full batches (docs/howto.md: exactness)
    assert plain.accelerator.native_amp
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    if before_split is not None:
        before_split(trainer)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    return plain, trainer, parts


def _assert_trains_as_plain(plain, trainer, parts):
    boundary = parts.split.boundary
    assert [key for key in boundary if "embed_tokens" in key], list(boundary)
    assert not [k for k, _ in parts.split.stage2.named_parameters() if "embed_tokens" in k]
    assert len(_logged(trainer, "loss")) == len(_logged(plain, "loss")) >= 4
    assert _logged(trainer, "loss", "grad_norm") == _logged(plain, "loss", "grad_norm")
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
    assert parts.cached is not None and len(parts.cached) == len(trainer.train_dataset)


def test_split_trainer_trains_as_the_plain_run_clm_trainer(tmp_path):
    _assert_trains_as_plain(*_train_both(tmp_path))


def test_checkpointing_enabled_before_split_trainer_trains_as_plain(tmp_path):
    """What train() will do, done by the user first (PEFT's recipes call it too)."""

    def enable(trainer):
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
        )

    _assert_trains_as_plain(*_train_both(tmp_path, enable))


def test_compute_loss_under_the_trainers_autocast_caches_bf16_frozen_work(tmp_path):
    trainer = _trainer(str(tmp_path / "out"))
    trainer.model.train()
    loss = TrainerLoss(trainer)
    rows = trainer.train_dataset
    example = default_data_collator([rows[i] for i in range(4)])
    split = graphsplit.split(loss, (example,))
    for batch in (example, default_data_collator([rows[i] for i in range(4, 7)])):
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)
    with prepared_forward(trainer, trainer.model):  # what the plain train() computes
        stage1 = split.stage1(**example)
    linears = {k: v for k, v in stage1.items() if "proj" in k}
    assert linears and all(v.dtype == torch.bfloat16 for v in linears.values()), {
        k: v.dtype for k, v in stage1.items()
    }
    assert not [k for k, _ in split.stage2.named_parameters() if "embed_tokens" in k]
