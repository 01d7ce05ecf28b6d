"""Conformance: TRL's ``CPOTrainer`` (no reference model: nothing frozen) through ``split_trainer``.

Upstream: ``trl/experimental/cpo/cpo_trainer.py`` (TRL 1.16), built as TRL's CPO docs build it
(``CPOTrainer(model=model, args=CPOConfig(...), processing_class=tokenizer,
train_dataset=train_dataset)`` on a (prompt, chosen, rejected) dataset) and run unmodified: its
``compute_loss`` -> ``get_batch_loss_metrics`` runs the policy on the concatenated chosen and
rejected rows (``concatenated_forward``), computes the CPO loss (sigmoid preference term plus the
NLL of the chosen completions) and logs metrics with ``.item()``. CPO has no reference model:
every parameter of the step trains, so there is nothing a cache could hold.

What graphsplit must do: refuse clearly, write nothing. Checked:

- ``split_trainer`` refuses, writes no cache, and its module-level note says the step calls no
  frozen module (passes);
- the refusal's headline is the whole-step trace's ``TrainableSideError``, whose fix asks to
  rewrite TRL's own metrics line with tensor ops (following it would cache nothing): strict
  xfail, with the diagnosis.

Model: ``Qwen2ForCausalLM``, 1 layer, hidden 16, vocab 64, random weights; a word-level
tokenizer built locally (``tests/integrations/dpo.py``).
"""

from __future__ import annotations

import pytest
import torch

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
    assert "cpo_trainer.py:" in whole
    assert "(the step calls no frozen module)" in whole, whole


@pytest.mark.xfail(
    strict=True,
    reason=(
        "split_trainer -> graphsplit/api.py:split (path='auto') raises the whole-step trace's "
        "TrainableSideError ('CPOTrainer.get_batch_loss_metrics reads tensor values and reads "
        "the trainable parameter ...', fix: 'replace .item()/.tolist()/nonzero-style code with "
        "tensor ops') pointing at TRL's metrics line (cpo_trainer.py: "
        "metrics[...] = ...mean().item()); the module-level path's finding, that the step calls "
        "no frozen module at all, is only a note. Nothing of a CPO step can be cached, so the "
        "headline fix sends the user to rewrite TRL for nothing. Proposed: split_trainer (or "
        "api.split) checks first whether the trainer's modules hold any frozen parameter and "
        "refuses with 'nothing to cache: every parameter trains (CPOTrainer has no reference "
        "model); train it as it is', or api.split leads with the module-level refusal when it "
        "found no frozen module called at all."
    ),
)
def test_the_refusal_leads_with_nothing_to_cache(tmp_path):
    headline = str(_refusal(tmp_path))
    assert "replace .item()" not in headline, headline
    assert "frozen" in headline.split("fix:", 1)[0], headline
