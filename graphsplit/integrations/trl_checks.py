"""Which TRL trainers graphsplit's trainer tools take, and what each refuses up front.

Two tools, two kinds of trainer: :func:`~graphsplit.integrations.trl.cache_reference_log_probs`
caches a ``trl.DPOTrainer``'s reference log-probs (one pair at a time, with TRL's own
``compute_ref_log_probs``); :func:`~graphsplit.integrations.transformers.split_trainer` splits a
trainer's ``compute_loss``. A trainer handed to the wrong one, or whose reference would not stay
what was cached, is refused by its type (``isinstance`` against TRL's classes, looked up only
where TRL is installed) before anything runs:

- ``KTOTrainer``: its reference log-probs include those of the KL term, computed on mismatched
  (prompt, completion) pairs TRL builds from chunks of the dataset: no one-pair step gives them.
  TRL precomputes both itself (``KTOConfig(precompute_ref_log_probs=True)``).
- a ``DPOTrainer`` in ``split_trainer``: ``cache_reference_log_probs`` is its tool.
- a ``DPOTrainer`` whose callbacks move the reference model during training (TRL's
  ``SyncRefModelCallback``, added by ``sync_ref_model=True``; the ``BEMACallback`` of
  ``trl.experimental.bema_for_ref_model`` with ``update_ref_model=True``): cached log-probs
  would go stale.
"""

from __future__ import annotations

import importlib
from typing import Any

from graphsplit.errors import Fix, SplitError, user_error

__all__ = ["check_reference_trainer", "refuse_preference_trainers"]

KTO_FIX = Fix(
    "build the KTOTrainer with KTOConfig(precompute_ref_log_probs=True) and train it as it is: "
    "TRL then computes the reference log-probs (the KL pairs' included) once, before training"
)


def kto_reference(trainer: Any) -> str:
    """What a ``KTOTrainer``'s reference log-probs are, and why a one-pair step misses them."""
    if getattr(trainer, "calculate_KL", True):
        return (
            "KTO's reference log-probs include the KL term's, computed on mismatched (prompt, "
            "completion) pairs TRL builds from chunks of the dataset"
        )
    return (
        "KTO's reference log-probs are of unpaired examples (one completion each), not of "
        "DPO's chosen/rejected pairs"
    )


def trl_class(name: str) -> type | None:
    """``trl.<name>``, or None where TRL (or that class) is not installed."""
    try:
        return getattr(importlib.import_module("trl"), name, None)
    except ImportError:
        return None


def is_a(trainer: Any, name: str) -> bool:
    cls = trl_class(name)
    return cls is not None and isinstance(trainer, cls)


def check_reference_trainer(trainer: Any) -> None:
    """Refuse, for ``cache_reference_log_probs``, a trainer that is not a ``DPOTrainer``, one
    whose reference model moves during training, and the DPO options it cannot cache."""
    name = type(trainer).__name__
    if is_a(trainer, "KTOTrainer"):
        raise user_error(
            SplitError,
            f"cache_reference_log_probs takes a trl.DPOTrainer, not a {name}: "
            f"{kto_reference(trainer)}, which its one-pair reference step does not compute.",
            fix=KTO_FIX,
        )
    if not is_a(trainer, "DPOTrainer"):
        raise user_error(
            SplitError,
            f"cache_reference_log_probs takes a trl.DPOTrainer, not a {name}: it caches DPO's "
            "reference log-probs with DPOTrainer.compute_ref_log_probs.",
            fix=Fix(
                "pass a trl.DPOTrainer; for a Trainer whose compute_loss calls frozen modules, "
                "use graphsplit.integrations.transformers.split_trainer(trainer, cache_dir)"
            ),
        )
    refuse_reference_updates(trainer)
    problem = None
    if getattr(trainer, "precompute_ref_logps", False):
        problem = "already precomputes its reference log-probs (precompute_ref_log_probs=True)"
    elif trainer.ref_model is None and not _is_peft(trainer.model):
        problem = "has no ref_model, and its model is no PEFT model whose base could be it"
    elif getattr(trainer, "_is_vision_dataset", False):
        problem = "has a vision dataset"
    if problem is not None:
        raise user_error(
            SplitError,
            f"cache_reference_log_probs cannot cache this DPOTrainer's reference: it {problem}.",
            fix=Fix(
                "build the DPOTrainer with precompute_ref_log_probs=False, a ref_model (or "
                "a peft_config: the base is then the reference), on a text dataset"
            ),
        )


def _is_peft(model: Any) -> bool:
    """A ``peft.PeftModel`` (TRL's ``peft_config`` makes one); False without peft."""
    try:
        peft_model = importlib.import_module("peft").PeftModel
    except ImportError:
        return False
    return isinstance(model, peft_model)


def refuse_reference_updates(trainer: Any) -> None:
    """Refuse a trainer one of whose callbacks writes into its reference model."""
    for callback in trainer.callback_handler.callbacks:
        if is_a(callback, "SyncRefModelCallback"):
            what = (
                "TRL's SyncRefModelCallback (sync_ref_model=True) mixes the policy into the "
                "reference model every ref_model_sync_steps"
            )
        elif is_a(callback, "BEMACallback") and getattr(callback, "update_ref_model", False):
            what = "a BEMACallback with update_ref_model=True overwrites the reference model"
        else:
            continue
        raise user_error(
            SplitError,
            f"cache_reference_log_probs cannot cache this {type(trainer).__name__}'s reference: "
            f"{what} during training, so log-probs cached before it would go stale.",
            fix=Fix(
                "train with a fixed reference (sync_ref_model=False, no callback that updates "
                "the reference model), or without the cache"
            ),
        )


def refuse_preference_trainers(trainer: Any) -> None:
    """Refuse, for ``split_trainer``, TRL's preference trainers: a ``DPOTrainer`` has its own
    tool, and a ``KTOTrainer``'s reference cannot be cached by either."""
    name = type(trainer).__name__
    if is_a(trainer, "KTOTrainer"):
        raise user_error(
            SplitError,
            f"split_trainer does not split a {name}: {kto_reference(trainer)}, which TRL "
            "precomputes itself.",
            fix=KTO_FIX,
        )
    if is_a(trainer, "DPOTrainer"):
        raise user_error(
            SplitError,
            f"split_trainer does not split a {name}: its frozen work is the reference model's "
            "log-probs, which graphsplit caches with TRL's own code in cache_reference_log_probs.",
            fix=Fix(
                "from graphsplit.integrations.trl import cache_reference_log_probs; "
                "cache_reference_log_probs(trainer, cache_dir); trainer.train()"
            ),
        )
