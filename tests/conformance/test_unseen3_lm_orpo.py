"""Conformance: ORPO with more than one pair per batch: why it is refused, and what it would take.

The step is ``ORPOTrainer.get_batch_loss_metrics`` on a LoRA Llama, as
tests/conformance/test_unseen2_lm_preference.py writes it (TRL 1.16,
``trl/experimental/orpo/orpo_trainer.py``).

Why it is refused. ``get_batch_logps`` scores the labels with TRL's ``selective_log_softmax``
(``trl/trainer/utils.py``), which for float32 logits computes
``torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])``: a Python loop over the rows
of the logits (the bf16 branch loops too). Iterating a traced tensor reads its first size as a
Python int, so the trace unrolls the loop into one ``logsumexp`` per row: at two pairs, 4 rows
(chosen and rejected concatenated); the planning probes a second batch size, reads 8, and
refuses (``Python control flow depends on the batch size``). The module-level path refuses too:
the trainer concatenates chosen and rejected along dim 0 *inside* the step
(``concatenated_inputs``), so every frozen call (the token embedding, layer 0's base
projections) sees ``2 * pairs`` rows that are not the batch's samples.

Whether it can be supported. Exactness alone would be easy to keep: an unrolled loop is exact for
batches of the traced size, so a plan that held for one batch size (every batch of the loader
that size, the last one dropped, stage 2 checking its row count) would be exact by
construction. It would cache nothing worth caching, though: the concatenation mixes the
samples' rows, so the only per-sample values before the first LoRA layer are the raw inputs
(as at one pair per batch, below, where the boundary is exactly the inputs). A useful split
needs graphsplit to read ``torch.cat([chosen, rejected], dim=0)`` of two batch-aligned tensors
as a batched layout (sample ``i`` is rows ``i`` and ``pairs + i``), so that frozen work on the
concatenation could be cached per sample and regrouped; and batch-size-keyed plans for the
unrolled loop. Neither is clean in a small change, so the refusal stays, sharpened: it shows
TRL's loop line with its code, and its fix names the way that works today for a loop inside a
library: a one-sample example, planned one sample per batch (``per_device_train_batch_size=1``,
accumulating gradients), whose stage 1 refuses a bigger batch with its own message.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import graphsplit
from tests.conformance.test_unseen2_lm_preference import (
    OddsRatioPreferenceOptimisation,
    _orpo_batch,
)
from tests.helpers import split_and_verify

trl_utils = pytest.importorskip("trl.trainer.utils")


def _loop_line() -> str:
    lines, start = inspect.getsourcelines(trl_utils.selective_log_softmax)
    offset = next(i for i, text in enumerate(lines) if "for lg in logits" in text)
    return f"trl/trainer/utils.py:{start + offset}  {lines[offset].strip()}"


@pytest.mark.parametrize("pairs", [2, 4])
def test_several_pairs_are_refused_at_trls_row_loop_with_the_line_and_a_usable_fix(pairs):
    torch.manual_seed(0)
    step = OddsRatioPreferenceOptimisation()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, _orpo_batch(pairs), path="trace")
    message = str(caught.value)
    rows = 2 * pairs
    assert message.startswith(
        f"Python control flow depends on the batch size: it read {rows} at batch size {pairs}"
    )
    assert _loop_line() in message  # the loop's line and its code
    words = caught.value.fix.words
    assert "split with a one-sample example batch" in words
    assert "planned one sample per batch" in words
    # path="auto" takes the module-level path, which caches the frozen base's calls on the
    # concatenation two rows a pair (tests/conformance/test_unseen2_lm_preference.py).
    assert graphsplit.split(step, _orpo_batch(pairs)).path == "calls"


def test_the_fix_a_one_pair_example_plans_one_pair_per_batch_and_refuses_two():
    """The refusal's fix: split with one pair; exact on other pairs, and a batch of two pairs
    is refused by stage 1 naming the input and the fix (batches of one)."""
    torch.manual_seed(0)
    step = OddsRatioPreferenceOptimisation()
    split = split_and_verify(step, _orpo_batch(1))
    assert split.batch_sizes == (1, 1)
    assert any(note.startswith("one sample per batch") for note in split.notes)
    # Nothing frozen is cached by this trace plan: the concatenation gives the frozen base two
    # rows a pair, which the whole-step trace cannot cut per sample.
    per_sample = {key for key, spec in split.boundary.items() if spec.batch_dim is not None}
    assert per_sample == set(split.input_names)
    assert all(c.ok for c in graphsplit.verify(step, split, _orpo_batch(1, seed=3), seed=1))
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(*_orpo_batch(2))
    assert "holds 2 samples" in str(caught.value)
    assert "this plan runs one sample per batch" in str(caught.value)
    assert "feed one sample per batch" in caught.value.fix.words
