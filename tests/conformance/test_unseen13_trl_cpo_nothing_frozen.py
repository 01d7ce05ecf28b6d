"""Conformance: TRL's ``CPOTrainer`` (no reference model: nothing frozen) through ``split_trainer``.

Upstream: ``trl/experimental/cpo/cpo_trainer.py`` (TRL 1.16), built as TRL's CPO docs build it
(``CPOTrainer(model=model, args=CPOConfig(...), processing_class=tokenizer,
train_dataset=train_dataset)`` on a (prompt, chosen, rejected) dataset) and run unmodified: its
``compute_loss`` -> ``get_batch_loss_metrics`` runs the policy on the concatenated chosen and
rejected rows (``concatenated_forward``), computes the CPO loss (sigmoid preference term plus the
NLL of the chosen completions) and logs metrics with ``.item()``. CPO has no reference model:
every parameter of the step trains, so there is nothing a cache could hold.

What graphsplit must do: refuse clearly, write nothing. Checked:

- ``split_trainer`` refuses, writes no cache, and says the step calls no frozen module;
- that leads the refusal: nothing of this step can be cached, train it as it is (the whole-step
  trace's ``TrainableSideError``, whose fix asked to rewrite TRL's own metrics line with tensor
  ops for nothing, used to be the headline; it is a note now).

Model: ``Qwen2ForCausalLM``, 1 layer, hidden 16, vocab 64, random weights; a word-level
tokenizer built locally (``tests/integrations/dpo.py``).
"""

from __future__ import annotations

import pytest
import torch

from graphsplit.calls.unfrozen import NOTHING_FROZEN_FIX
from graphsplit.errors import GraphsplitError

pytest.importorskip("trl")
from trl.experimental.cpo import CPOConfig, CPOTrainer

from graphsplit.integrations.transformers import split_trainer
from tests.integrations.dpo import preference_pairs, tiny_qwen2, word_tokenizer


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_trainer(output_dir: str) -> CPOTrainer:
    training_args = CPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=2,
        max_length=32,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    return CPOTrainer(
        model=tiny_qwen2(1),
        args=training_args,
        processing_class=word_tokenizer(),
        train_dataset=preference_pairs(8),
    )


def _refusal(tmp_path) -> GraphsplitError:
    trainer = make_trainer(str(tmp_path / "out"))
    assert all(p.requires_grad for p in trainer.model.parameters())  # nothing frozen
    with pytest.raises(GraphsplitError) as caught:
        split_trainer(trainer, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    return caught.value


def test_split_trainer_refuses_a_trainer_with_nothing_frozen_and_writes_nothing(tmp_path):
    error = _refusal(tmp_path)
    whole = "\n".join([str(error), *getattr(error, "__notes__", [])])
    assert "cpo_trainer.py:" in whole  # the trace's refusal, kept as a note
    assert "it calls no frozen module" in whole, whole


def test_the_refusal_leads_with_nothing_to_cache(tmp_path):
    """It used to lead with the trace's TrainableSideError, whose fix sent the user to rewrite
    TRL's metrics line for nothing: a CPO step holds nothing frozen to cache."""
    headline = str(_refusal(tmp_path))
    assert "replace .item()" not in headline, headline
    assert headline.startswith("nothing of this step can be cached"), headline
    assert NOTHING_FROZEN_FIX.words in headline
