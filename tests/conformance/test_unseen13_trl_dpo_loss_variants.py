"""Conformance: TRL's ``DPOTrainer`` with IPO, robust (label-smoothed) and RPO losses, its
reference log-probs cached by ``graphsplit.integrations.trl.cache_reference_log_probs``.

Upstream: ``trl/scripts/dpo.py`` (TRL 1.16: ``DPOTrainer(model, ref_model, args=DPOConfig(...),
train_dataset=..., eval_dataset=..., processing_class=tokenizer)`` then ``trainer.train()``)
with ``precompute_ref_log_probs=False`` and an explicit reference model, run unmodified, with
the loss options users set in ``DPOConfig``:

- ``loss_type=["ipo"]``: TRL's IPO divides each completion's log-ratio by its number of
  completion tokens (``completion_mask`` of the batch) before the squared loss;
- ``loss_type=["robust"], label_smoothing=0.1``: TRL 1.16's label-smoothed DPO (its
  ``"sigmoid"`` branch no longer reads ``label_smoothing``; the robust and EXO losses do);
- ``loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]``: RPO. TRL 1.16 removed
  ``rpo_alpha``; its paper index gives RPO as this multi-loss (the ``sft`` term is the policy's
  mean NLL on the chosen tokens, weighted by the old ``rpo_alpha``).

Each option changes only what ``_compute_loss`` does with the policy's and reference's
log-probs, so the cached reference must give, for each, TRL's own ``precompute_ref_log_probs=
True`` run (batch 1, as graphsplit computes each pair) bit for bit: logged losses and grad
norms, final weights, eval loss; and TRL's live-reference run (batches of 4 padded together)
within 1e-6 relative, as ``tests/integrations/test_trl_dpo.py`` checks the sigmoid loss.
Stage 2 of the reference split holds no weights (the reference is all stage 1).

Policy and reference: ``Qwen2ForCausalLM``, 1 layer, hidden 16, vocab 64, random weights; a
word-level tokenizer built locally (``tests/integrations/dpo.py``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from graphsplit.integrations.trl import cache_reference_log_probs
from tests.integrations.dpo import make_dpo_trainer, preference_pairs

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")

LOSSES = {
    "ipo": {"loss_type": ["ipo"]},
    "robust_label_smoothing": {"loss_type": ["robust"], "label_smoothing": 0.1},
    "rpo_sigmoid_plus_sft": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry and "eval" not in key]


@pytest.mark.parametrize("name", list(LOSSES))
def test_cached_reference_trains_as_trls_precomputed_run_bit_for_bit(tmp_path, name):
    options = LOSSES[name]
    pairs = preference_pairs(8)
    trl_run = make_dpo_trainer(
        str(tmp_path / "trl"),
        pairs,
        max_steps=2,
        precompute_ref_log_probs=True,
        precompute_ref_batch_size=1,
        **options,
    )
    ours = make_dpo_trainer(str(tmp_path / "ours"), pairs, max_steps=2, **options)
    live = make_dpo_trainer(str(tmp_path / "live"), pairs, max_steps=2, **options)
    assert ours.loss_types == options["loss_type"] and not ours.precompute_ref_logps

    reference = cache_reference_log_probs(ours, str(tmp_path / "ref"))
    assert reference.split.stage2.state_dict() == {}  # the reference is all stage 1
    assert len(reference.cached["train"]) == 8 and len(reference.cached["eval"]) == 4
    for column in COLUMNS:
        assert list(ours.train_dataset[column]) == list(trl_run.train_dataset[column])
        assert list(ours.eval_dataset[column]) == list(trl_run.eval_dataset[column])

    for trainer in (trl_run, ours, live):
        trainer.train()
    assert len(_logged(ours, "loss")) == 2
    assert _logged(ours, "loss") == _logged(trl_run, "loss")
    assert _logged(ours, "grad_norm") == _logged(trl_run, "grad_norm")
    trained, expected = ours.model.state_dict(), trl_run.model.state_dict()
    assert all(torch.equal(trained[key], expected[key]) for key in expected)
    assert ours.evaluate()["eval_loss"] == trl_run.evaluate()["eval_loss"]
    assert _logged(ours, "loss") == pytest.approx(_logged(live, "loss"), rel=1e-6)
