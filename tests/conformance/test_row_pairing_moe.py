"""A LoRA MoE language model (Mixtral, Qwen2-MoE) is reported as pairing rows, though its
causal-LM loss treats the batch as a set: the known over-report of graphsplit.row_pairing.

Its cache is exact (read in whole stage-1 batches), only less free: ``cached.loader`` takes the
cached batch size alone. Built as test_unseen2_lm_moe.py builds it (3 rows, LoRA on the
attention, the experts frozen).
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.conformance.test_unseen2_lm_moe import (
    CausalLanguageModelling,
    _batch,
    _mixtral,
    _qwen2_moe,
    _with_lora,
)

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.mark.xfail(
    strict=True,
    reason=(
        "graphsplit/row_pairing.py:_meetings compares each op output's NaN parts across runs "
        "by position in the output; a NaN row's router logits make the top-k pick other "
        "experts, so transformers/integrations/moe.py's grouped dispatch sorts the tokens in "
        "another order (hidden_states[perm]) and the rows of that output hold other tokens in "
        "that run: tokens of two rows appear to meet there, and the swapped runs move them "
        "differently, so it is reported as by position. Fix: leave out runs in which an integer "
        "index output (argsort, topk indices) differs from the base run's, as a run NaN "
        "steered (which would also leave out runs of steps that take an argmax metric)"
    ),
)
@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_a_lora_moe_language_model_pairs_no_rows(build):
    torch.manual_seed(0)
    step = CausalLanguageModelling(_with_lora(build()), router_aux=False)
    split = graphsplit.split(step, _batch(3))
    assert split.paired_rows is None, split.paired_rows.describe()
