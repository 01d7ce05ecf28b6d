"""Conformance: batches kept as the collators return them, not converted to a dict first.

``DataCollatorWithPadding`` returns a ``BatchEncoding`` (a ``UserDict``, not a ``dict``);
scripts hand it to the step as it is, and some read it by attribute (``batch.input_ids``) or
move it whole (``batch.to(device)``). The KD + SFT step and models are
``test_unseen2_data_text``'s; the batch goes through ``split``, ``verify`` and the cache
unconverted, and stage 2 on the cached rows trains as the step, loss and gradients bit for bit.
Its fields become stage 1's inputs as a dict's do, and the step gets a ``BatchEncoding`` back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from tests.conformance import test_unseen2_data_text as text
from tests.conformance.unseen2_data_checks import assert_cache_round_trip

transformers = pytest.importorskip("transformers")

teacher, student = text.teacher, text.student  # the script's globals

SEEN: list[type] = []
"""The type of each batch ``attribute_step`` got, outside a trace."""


def attribute_step(batch):
    """The KD + SFT step as scripts write it against a ``BatchEncoding``."""
    if not isinstance(batch.input_ids, torch.fx.Proxy):
        SEEN.append(type(batch))
    batch = batch.to("cpu")
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    with torch.no_grad():
        teacher_logits = teacher(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits
    outputs = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    kd = F.kl_div(
        F.log_softmax(outputs.logits, dim=-1),
        F.softmax(teacher_logits / 2.0, dim=-1),
        reduction="batchmean",
    )
    return outputs.loss + 0.5 * kd


def _loader() -> DataLoader:
    dataset, collate_fn = text.COLLATORS["with_padding"]()
    return DataLoader(dataset, batch_size=3, collate_fn=collate_fn)


def test_a_batch_encoding_as_the_collator_returns_it(tmp_path):
    loader = _loader()
    first = next(iter(loader))
    assert isinstance(first, transformers.BatchEncoding) and not isinstance(first, dict)
    split = graphsplit.split(text.training_step, (first,))
    assert all(c.ok for c in graphsplit.verify(text.training_step, split, (first,)))
    assert_cache_round_trip(split, text.training_step, loader, tmp_path / "cache", text.PARAMS)


@pytest.mark.parametrize("path", ["trace", "calls"])
def test_a_step_reading_the_batch_encoding_by_attribute_gets_one_back(path, tmp_path):
    loader = _loader()
    first = next(iter(loader))
    split = graphsplit.split(attribute_step, (first,), path=path)
    assert split.input_names[:2] == ("input_ids", "attention_mask")  # its fields, as a dict's
    assert all(c.ok for c in graphsplit.verify(attribute_step, split, (first,)))
    SEEN.clear()
    assert_cache_round_trip(split, attribute_step, loader, tmp_path / "cache", text.PARAMS)
    assert SEEN and set(SEEN) == {transformers.BatchEncoding}
