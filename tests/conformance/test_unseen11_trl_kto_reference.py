"""Conformance: TRL's ``KTOTrainer`` with a reference model, its ``compute_loss`` split.

Upstream: ``trl/scripts/kto.py`` (TRL 1.16: ``KTOTrainer(model=..., args=KTOConfig(...),
train_dataset=..., ...)`` then ``trainer.train()``) with an explicit ``ref_model`` (the
trainer's documented argument), and ``trl/trainer/kto_trainer.py`` run unmodified: the dataset
is unpaired (``prompt``, ``completion``, a boolean ``label``: desirable or not), TRL's
``_prepare_dataset`` adds ``KL_completion_ids`` by rotating the completions by one within each
chunk of ``per_device_train_batch_size`` rows (the KL term's mismatched pairs),
``DataCollatorForUnpairedPreference`` pads each batch, and ``_compute_loss`` runs the policy
(with grad) and, under ``torch.no_grad()``, the policy on the KL pairs and the reference on both
the completions and the KL pairs (``fused_lm_head=True``: TRL's fused log-prob head), selects
the desirable/undesirable rows with ``torch.nonzero`` and logs metrics with ``.item()``.

Two ways in:

- ``split_trainer`` refuses a ``KTOTrainer`` (a legitimate refusal: its KL term's reference
  log-probs are of pairs TRL builds from chunks of the dataset) and names the fix,
  ``KTOConfig(precompute_ref_log_probs=True)``; nothing is written.
- ``graphsplit.split`` on the trainer's ``compute_loss`` (``TrainerLoss``, the default path):
  the whole-step trace refuses the value reads and the module-level path caches the frozen
  reference's two calls per batch; ``verify`` holds bit for bit on the trainer's own batches of
  4 and on a batch of 2; stage 2 holds no ``ref_model`` weights; a cache of the trainer's
  dataloader round-trips through disk with the eager step's losses and gradients.

The reference is frozen (``requires_grad_(False)``) by the test: TRL leaves it trainable.
Policy and reference: ``Qwen2ForCausalLM``, 2 layers, hidden 32, vocab 128, random weights; a
word-level tokenizer built locally.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from graphsplit.errors import GraphsplitError, SplitError
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import stage2_top_modules
from tests.helpers import assert_stage1_holds_no_trainable

pytest.importorskip("trl")
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import KTOConfig, KTOTrainer

from graphsplit.integrations.transformers import TrainerLoss, split_trainer
from tests.integrations.dpo import word_tokenizer

VOCAB = 128


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        )
    )


def unpaired_examples(count: int = 8) -> Dataset:
    generator = torch.Generator().manual_seed(3)

    def words(n: int) -> str:
        ids = torch.randint(2, 64, (n,), generator=generator).tolist()
        return " ".join(f"t{i}" for i in ids)

    return Dataset.from_list(
        [
            {"prompt": words(2 + i % 3), "completion": " " + words(2 + i % 4), "label": i % 3 != 1}
            for i in range(count)
        ]
    )


def make_trainer(output_dir: str, *, freeze_reference: bool = True) -> KTOTrainer:
    training_args = KTOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=2,
        beta=0.1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    reference = tiny_qwen2(2)
    if freeze_reference:
        reference.requires_grad_(False)
    return KTOTrainer(
        model=tiny_qwen2(1),
        ref_model=reference,
        args=training_args,
        train_dataset=unpaired_examples(),
        processing_class=word_tokenizer(),
    )


def _batches(trainer: KTOTrainer) -> list[dict]:
    return [dict(batch) for batch in trainer.get_train_dataloader()]


def _collated(trainer: KTOTrainer, indices: list[int]) -> dict:
    return dict(trainer.data_collator([trainer.train_dataset[i] for i in indices]))


# -- tests ---------------------------------------------------------------------------------------
def test_the_batches_carry_the_kl_pairs_trl_built(tmp_path):
    trainer = make_trainer(str(tmp_path))
    assert trainer.calculate_KL and not trainer.precompute_ref_logps
    rows = trainer.train_dataset
    # the KL completion of row 1 is row 0's completion (rotated within a chunk of 4)
    assert rows[1]["KL_completion_ids"] == rows[0]["completion_ids"]
    batch = _batches(trainer)[0]
    assert {"KL_input_ids", "KL_attention_mask", "KL_completion_mask", "label"} <= set(batch)


def test_split_trainer_refuses_kto_naming_trls_precompute(tmp_path):
    trainer = make_trainer(str(tmp_path / "out"))
    with pytest.raises(SplitError) as caught:
        split_trainer(trainer, str(tmp_path / "cache"))
    message = str(caught.value)
    assert message.startswith("split_trainer does not split a KTOTrainer")
    assert "precompute_ref_log_probs=True" in message.split("fix:", 1)[1]
    assert not (tmp_path / "cache").exists()


def test_compute_loss_split_caches_the_reference_and_verifies_on_two_batch_sizes(tmp_path):
    trainer = make_trainer(str(tmp_path / "out"))
    loss = TrainerLoss(trainer)
    first, second = _batches(trainer)
    split = graphsplit.split(loss, (first,))
    for batch in (first, second, _collated(trainer, [0, 1])):
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)

    assert "ref_model" not in stage2_top_modules(split)
    assert not any(key.startswith("ref_model.") for key in split.stage2.state_dict())
    cached = [key for key in split.boundary if key.startswith("ref_model")]
    assert len({key.split("__")[1] for key in cached}) == 2, cached  # both reference calls
    assert_stage1_holds_no_trainable(split)
    assert split.report().startswith("graphsplit plan for forward (module-level path)")


def test_compute_loss_split_round_trips_the_trainers_loader_through_disk(tmp_path):
    trainer = make_trainer(str(tmp_path / "out"))
    loss = TrainerLoss(trainer)
    loader = _batches(trainer)
    split = graphsplit.split(loss, (loader[0],))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)


# -- the reference as TRL leaves it (trainable, called under torch.no_grad()) -------------------
def _refusal_as_written(tmp_path) -> GraphsplitError:
    trainer = make_trainer(str(tmp_path / "out"), freeze_reference=False)
    assert all(p.requires_grad for p in trainer.ref_model.parameters())  # TRL does not freeze it
    loss = TrainerLoss(trainer)
    with pytest.raises(GraphsplitError) as caught:
        graphsplit.split(loss, (_batches(trainer)[0],))
    return caught.value


def _whole(error: BaseException) -> str:
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


def test_a_trainable_reference_is_refused_naming_trls_line(tmp_path):
    error = _refusal_as_written(tmp_path)
    assert "kto_trainer.py:" in str(error)
    assert "the step calls no frozen module" in _whole(error)  # the module-level path's note


def test_the_refusal_of_a_trainable_reference_names_the_fix_that_caches_it(tmp_path):
    """With the reference as TRL leaves it (``requires_grad=True``, only ever called under
    ``torch.no_grad()``), the module-level path's refusal said only "(the step calls no frozen
    module)", and the trace's fix asked to rewrite TRL's own ``nonzero``. It now names
    ``ref_model``, the line of its first call, and the fix that caches it (the tests above)."""
    whole = _whole(_refusal_as_written(tmp_path))
    assert "ref_model: every call ran under no_grad (first at " in whole, whole
    assert "kto_trainer.py:" in whole.split("ref_model: every call", 1)[1]
    assert "it suggests: if ref_model is not trained, freeze it before splitting" in whole
    assert "(ref_model.requires_grad_(False))" in whole
