"""Conformance: TRL's ``DPOTrainer`` with a multi-loss (``sigmoid`` + ``bco_pair``) and WPO
weighting, and with LD-DPO's ``ld_alpha``, a frozen reference model beside the policy.

Upstream: ``trl/scripts/dpo.py`` (TRL 1.16: ``DPOTrainer(model, ref_model, args=DPOConfig(...),
train_dataset=..., processing_class=tokenizer)`` then ``trainer.train()``) and
``trl/trainer/dpo_trainer.py`` run unmodified, with the ``DPOConfig`` options users set:

- ``loss_type=["sigmoid", "bco_pair"], loss_weights=[1.0, 0.5], use_weighting=True``: the
  paper index's MPO-style combination with the pairwise BCO loss, each pair's loss weighted by
  WPO's ``exp`` of the policy's length-normalised log-prob alignment (``_compute_loss`` reads
  the fused head's ``log_sum_sq_probs`` under ``torch.no_grad()``);
- ``ld_alpha=0.5`` (LD-DPO): the log-probs of the tokens past the shorter completion of a pair
  are scaled by ``ld_alpha``, for the policy and the reference alike
  (``compute_ref_log_probs`` and ``_compute_loss`` both split each row at the pair's shared
  length).

Checked:

- ``cache_reference_log_probs`` gives TRL's own ``precompute_ref_log_probs=True`` run
  (``precompute_ref_batch_size=1``) bit for bit: the reference columns, the logged losses and
  grad norms, for both (``ld_alpha`` used to be refused, though the pair, the one sample of
  the reference step, determines its shared length);
- ``graphsplit.split`` on the trainer's ``compute_loss`` (``TrainerLoss``, the default path),
  for both options: ``verify`` bit for bit on the trainer's two batches of 4 pairs and on one
  of 2; stage 2 holds no ``ref_model`` weight; stage 1 no trainable one; a cache of the
  trainer's dataloader round-trips through disk.

The reference is frozen by the test for the ``split`` path (TRL leaves it trainable and calls it
under ``torch.no_grad()``; test_unseen11_trl_kto_reference.py checks that refusal's fix).
Policy and reference: ``Qwen2ForCausalLM``, 1 layer, hidden 16, vocab 64, random weights; a
word-level tokenizer built locally (``tests/integrations/dpo.py``).
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import stage2_top_modules
from tests.helpers import assert_stage1_holds_no_trainable

pytest.importorskip("trl")

from accelerate.state import AcceleratorState

from graphsplit.integrations.transformers import TrainerLoss
from graphsplit.integrations.trl import cache_reference_log_probs
from tests.integrations.dpo import make_dpo_trainer, preference_pairs

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")

OPTIONS = {
    "sigmoid_bco_pair_wpo": {
        "loss_type": ["sigmoid", "bco_pair"],
        "loss_weights": [1.0, 0.5],
        "use_weighting": True,
    },
    "ld_alpha": {"ld_alpha": 0.5},
}


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


def _trainer(folder, name: str, **arguments):
    return make_dpo_trainer(
        str(folder), preference_pairs(8), max_steps=2, bf16=False, **OPTIONS[name], **arguments
    )


def _logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry and "eval" not in key]


def _batches(trainer) -> list[dict]:
    return [dict(batch) for batch in trainer.get_train_dataloader()]


def _collated(trainer, indices: list[int]) -> dict:
    return dict(trainer.data_collator([trainer.train_dataset[i] for i in indices]))


@pytest.mark.parametrize(
    "name",
    [
        "sigmoid_bco_pair_wpo",
        "ld_alpha",
    ],
)
def test_cached_reference_trains_as_trls_precomputed_run_bit_for_bit(tmp_path, name):
    trl_run = _trainer(
        tmp_path / "trl", name, precompute_ref_log_probs=True, precompute_ref_batch_size=1
    )
    ours = _trainer(tmp_path / "ours", name)
    if name == "sigmoid_bco_pair_wpo":
        assert ours.loss_types == ["sigmoid", "bco_pair"] and ours.use_weighting
    else:
        assert ours.ld_alpha == 0.5

    reference = cache_reference_log_probs(ours, str(tmp_path / "ref"))
    assert reference.split.stage2.state_dict() == {}  # the reference is all stage 1
    assert len(reference.cached["train"]) == 8
    for column in COLUMNS:
        assert list(ours.train_dataset[column]) == list(trl_run.train_dataset[column])
    trl_run.train()
    ours.train()
    assert len(_logged(ours, "loss")) == 2
    assert _logged(ours, "loss") == _logged(trl_run, "loss")
    assert _logged(ours, "grad_norm") == _logged(trl_run, "grad_norm")
    trained, expected = ours.model.state_dict(), trl_run.model.state_dict()
    assert all(torch.equal(trained[key], expected[key]) for key in expected)


def _split(folder, name):
    trainer = _trainer(folder, name)
    trainer.ref_model.requires_grad_(False)
    loss = TrainerLoss(trainer)
    return trainer, loss, graphsplit.split(loss, (_batches(trainer)[0],))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_compute_loss_split_verifies_and_stage2_holds_no_reference(tmp_path, name):
    trainer, loss, split = _split(tmp_path / "out", name)
    first, second = _batches(trainer)
    for batch in (first, second, _collated(trainer, [1, 6])):  # 4, 4 and 2 pairs
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)
    assert "ref_model" not in stage2_top_modules(split)
    assert not any(key.startswith("ref_model.") for key in split.stage2.state_dict())
    cached = [key for key in split.boundary if key.startswith("ref_model")]
    assert cached == ["ref_model__0__log_probs"], list(split.boundary)
    assert_stage1_holds_no_trainable(split)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_compute_loss_split_round_trips_the_trainers_loader_through_disk(tmp_path, name):
    trainer, loss, split = _split(tmp_path / "out", name)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, _batches(trainer), tmp_path / "cache", params)
