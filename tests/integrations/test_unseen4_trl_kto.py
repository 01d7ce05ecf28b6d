"""TRL trainers beyond DPO at graphsplit's two trainer tools: each refused by its type, before
anything runs, with the reason and the tool or option that fits it.

``cache_reference_log_probs`` caches a ``DPOTrainer``'s reference with a one-pair step: a
``KTOTrainer`` (its KL term's mismatched pairs, or its unpaired examples) and any other trainer
are refused, and so is a ``DPOTrainer`` whose reference model moves during training
(``sync_ref_model=True``). ``split_trainer`` refuses both preference trainers, naming
``cache_reference_log_probs`` for DPO. The trainers are real, tiny (:mod:`.dpo`,
:mod:`.unseen4_kto`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from transformers import Trainer, TrainingArguments
from trl import BEMACallback, DPOConfig

from graphsplit.errors import SplitError
from graphsplit.integrations.transformers import split_trainer
from graphsplit.integrations.trl import cache_reference_log_probs
from tests.integrations.dpo import make_dpo_trainer, preference_pairs, tiny_qwen2, word_tokenizer
from tests.integrations.unseen4_kto import make_kto_trainer, unpaired_preferences

FIX_LINE = "  fix:    "
KTO_FIX = FIX_LINE + "build the KTOTrainer with KTOConfig(precompute_ref_log_probs=True)"


def _refusal(tool, trainer, folder) -> str:
    with pytest.raises(SplitError) as caught:
        tool(trainer, str(folder))
    assert not folder.exists()  # refused before anything is written
    return str(caught.value)


@pytest.fixture(scope="module")
def kto_trainer(tmp_path_factory):
    return make_kto_trainer(str(tmp_path_factory.mktemp("kto")), unpaired_preferences(8))


def test_a_kto_trainer_is_refused_naming_its_kl_pairs_and_trls_precompute(kto_trainer, tmp_path):
    assert kto_trainer.calculate_KL and not kto_trainer.precompute_ref_logps
    message = _refusal(cache_reference_log_probs, kto_trainer, tmp_path / "ref")
    assert message.startswith(
        "cache_reference_log_probs takes a trl.DPOTrainer, not a KTOTrainer: KTO's reference "
        "log-probs include the KL term's, computed on mismatched (prompt, completion) pairs"
    )
    assert KTO_FIX in message


def test_split_trainer_refuses_a_kto_trainer_with_the_same_fix(kto_trainer, tmp_path):
    message = _refusal(split_trainer, kto_trainer, tmp_path / "cache")
    # Refused as KTO, not as a trainer that builds its own batches (it overrides the sampler).
    assert message.startswith("split_trainer does not split a KTOTrainer: KTO's reference")
    assert "builds its training batches itself" not in message
    assert KTO_FIX in message


def test_an_unpaired_kto_loss_is_refused_without_a_kl_term(tmp_path):
    trainer = make_kto_trainer(
        str(tmp_path / "out"), unpaired_preferences(8), loss_type="apo_zero_unpaired"
    )
    assert not trainer.calculate_KL
    message = _refusal(cache_reference_log_probs, trainer, tmp_path / "ref")
    assert "KTO's reference log-probs are of unpaired examples (one completion each)" in message
    assert "KL" not in message.split(FIX_LINE)[0]


def test_split_trainer_refuses_a_dpo_trainer_naming_cache_reference_log_probs(tmp_path):
    trainer = make_dpo_trainer(str(tmp_path / "out"), preference_pairs(4))
    message = _refusal(split_trainer, trainer, tmp_path / "cache")
    assert message.startswith("split_trainer does not split a DPOTrainer")
    assert (
        FIX_LINE + "from graphsplit.integrations.trl import cache_reference_log_probs; "
        "cache_reference_log_probs(trainer, cache_dir); trainer.train()"
    ) in message


def test_a_dpo_trainer_that_syncs_its_reference_is_refused(tmp_path):
    trainer = make_dpo_trainer(
        str(tmp_path / "out"), preference_pairs(4), sync_ref_model=True, ref_model_sync_steps=2
    )
    message = _refusal(cache_reference_log_probs, trainer, tmp_path / "ref")
    assert "TRL's SyncRefModelCallback (sync_ref_model=True) mixes the policy into" in message
    assert "would go stale" in message
    assert FIX_LINE + "train with a fixed reference (sync_ref_model=False" in message


def test_a_bema_callback_that_updates_the_reference_is_refused(tmp_path):
    """TRL's BEMA-for-the-reference recipe (``trl.experimental.bema_for_ref_model``): its
    ``DPOTrainer`` hands the callbacks the reference model, and ``update_ref_model=True``
    overwrites it with the policy's BEMA weights every ``ref_model_update_freq`` steps."""
    bema = pytest.importorskip("trl.experimental.bema_for_ref_model")
    trainer = bema.DPOTrainer(
        model=tiny_qwen2(1),
        ref_model=tiny_qwen2(2),
        args=DPOConfig(str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=1),
        train_dataset=preference_pairs(4),
        processing_class=word_tokenizer(),
        callbacks=[bema.BEMACallback(update_ref_model=True, ref_model_update_freq=2)],
    )
    message = _refusal(cache_reference_log_probs, trainer, tmp_path / "ref")
    assert "a BEMACallback with update_ref_model=True overwrites the reference model" in message
    assert FIX_LINE + "train with a fixed reference" in message


def test_a_bema_callback_that_leaves_the_reference_alone_is_cached(tmp_path):
    trainer = make_dpo_trainer(str(tmp_path / "out"), preference_pairs(4))
    trainer.add_callback(BEMACallback())
    reference = cache_reference_log_probs(trainer, str(tmp_path / "ref"))
    assert len(reference.cached["train"]) == 4
    assert trainer.precompute_ref_logps


def test_a_plain_trainer_is_refused_naming_split_trainer(tmp_path):
    arguments = TrainingArguments(str(tmp_path / "out"), report_to=[], use_cpu=True)
    trainer = Trainer(model=tiny_qwen2(1), args=arguments, train_dataset=[{"input_ids": [2]}])
    message = _refusal(cache_reference_log_probs, trainer, tmp_path / "ref")
    assert message.startswith("cache_reference_log_probs takes a trl.DPOTrainer, not a Trainer")
    assert "split_trainer(trainer, cache_dir)" in message
