"""TRL's DPOTrainer (tiny Qwen2, CPU) trained from reference log-probs cached by graphsplit.

The reference: TRL's own run with ``precompute_ref_log_probs=True`` and
``precompute_ref_batch_size=1`` (each pair alone, as graphsplit computes it). Its reference
columns and training losses are compared with ``==`` (bit for bit), the policies with
``torch.equal``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from graphsplit.errors import SplitError, StaleCacheError
from graphsplit.integrations.trl import cache_reference_log_probs
from tests.caching.fixtures import worker_environment
from tests.helpers import two_process_launch
from tests.integrations.dpo import make_dpo_trainer, preference_pairs

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_dpo_from_the_cache_is_trls_precomputed_run_bit_for_bit(tmp_path):
    pairs = preference_pairs(12)
    trl_run = make_dpo_trainer(
        str(tmp_path / "trl"), pairs, precompute_ref_log_probs=True, precompute_ref_batch_size=1
    )
    ours = make_dpo_trainer(str(tmp_path / "ours"), pairs)
    reference = cache_reference_log_probs(ours, str(tmp_path / "ref"))
    assert reference.split.stage2.state_dict() == {}  # the reference is all stage 1
    assert len(reference.cached["train"]) == 12 and len(reference.cached["eval"]) == 4
    for column in COLUMNS:
        assert list(ours.train_dataset[column]) == list(trl_run.train_dataset[column])
        assert list(ours.eval_dataset[column]) == list(trl_run.eval_dataset[column])
    trl_run.train()
    ours.train()
    assert _losses(ours) == _losses(trl_run) and len(_losses(ours)) == 3
    trained, expected = ours.model.state_dict(), trl_run.model.state_dict()
    assert all(torch.equal(trained[key], expected[key]) for key in expected)
    assert ours.evaluate()["eval_loss"] == trl_run.evaluate()["eval_loss"]


def test_dpo_from_the_cache_matches_the_live_reference_run(tmp_path):
    """Against TRL computing the reference in every training batch (4 pairs, padded to the
    longest): tolerance 1e-6 relative, as those log-probs come from other matmul shapes than
    one pair's (the last bits may differ; on this model they happen to agree)."""
    pairs = preference_pairs(12)
    live = make_dpo_trainer(str(tmp_path / "live"), pairs)
    ours = make_dpo_trainer(str(tmp_path / "ours"), pairs)
    cache_reference_log_probs(ours, str(tmp_path / "ref"))
    live.train()
    ours.train()
    assert _losses(ours) == pytest.approx(_losses(live), rel=1e-6)


def test_the_cache_is_reused_and_refused_for_another_reference(tmp_path):
    pairs = preference_pairs(6)
    cache_reference_log_probs(make_dpo_trainer(str(tmp_path / "a"), pairs), str(tmp_path / "ref"))
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ref" / "train").iterdir()}
    again = make_dpo_trainer(str(tmp_path / "b"), pairs)
    cache_reference_log_probs(again, str(tmp_path / "ref"))  # same weights: reused
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ref" / "train").iterdir()} == written
    changed = make_dpo_trainer(str(tmp_path / "c"), pairs)
    with torch.no_grad():
        changed.ref_model.lm_head.weight.add_(1.0)
    with pytest.raises(StaleCacheError, match="weights"):
        cache_reference_log_probs(changed, str(tmp_path / "ref"))


def test_a_trainer_that_already_precomputes_is_refused_with_the_fix(tmp_path):
    trainer = make_dpo_trainer(str(tmp_path), preference_pairs(4), precompute_ref_log_probs=True)
    with pytest.raises(SplitError, match="already precomputes") as error:
        cache_reference_log_probs(trainer, str(tmp_path / "ref"))
    assert "precompute_ref_log_probs=False, a ref_model (or a peft_config" in str(error.value)


def test_a_trainer_with_neither_a_ref_model_nor_a_peft_model_is_refused(tmp_path):
    """TRL always has one of the two; a trainer whose ref_model was taken away by hand has no
    reference to cache (a LoRA policy's base is one: test_unseen15_trl_dpo_lora_null_reference)."""
    trainer = make_dpo_trainer(str(tmp_path), preference_pairs(4))
    trainer.ref_model = None
    with pytest.raises(SplitError) as error:
        cache_reference_log_probs(trainer, str(tmp_path / "ref"))
    message = str(error.value)
    assert "has no ref_model, and its model is no PEFT model whose base could be it" in message
    assert "a ref_model (or a peft_config" in message
    assert not (tmp_path / "ref").exists()


@pytest.mark.slow  # about 21 s: two processes each build and train two trainers
def test_two_accelerate_processes_cache_their_shares_and_train_as_trl(tmp_path):
    """Under ``accelerate launch`` (2 CPU processes, gloo DDP) each process caches its share
    of the pairs; every process reads TRL's single-process batch-1 values back, and trains to
    TRL's live-reference losses (within 1e-6 relative, as above)."""
    pytest.importorskip("accelerate")
    pairs = preference_pairs(12)
    expected = make_dpo_trainer(
        str(tmp_path / "trl"), pairs, precompute_ref_log_probs=True, precompute_ref_batch_size=1
    )
    worker = Path(__file__).with_name("dpo_worker.py")
    command = two_process_launch(str(worker), str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    finished = subprocess.run(command, env=worker_environment(), capture_output=True, timeout=300)
    assert finished.returncode == 0, finished.stderr.decode()[-4000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / "run" / f"report.{rank}.json").read_text())
        assert report["world"] == 2 and report["cached"] == 12
        for column in COLUMNS:
            assert report["columns"][column] == list(expected.train_dataset[column])
        assert report["ours"] == pytest.approx(report["live"], rel=1e-6)
        assert len(report["ours"]) == 3
