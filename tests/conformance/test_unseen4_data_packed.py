"""Conformance: packed batches (``DataCollatorWithFlattening``): one row of concatenated samples.

transformers' ``DataCollatorWithFlattening`` (and TRL's ``padding_free=True``) concatenate a
batch's samples into one row with ``position_ids`` restarting at each sample and no attention
mask; Llama's masking then attends within each sample only. A row is several samples, so a
per-sample cache keyed by dataset index has nothing to key: graphsplit treats the packed row as
the sample where the user passes the packed batches as they come (exact, bit for bit), and
refuses a ``DataLoader`` over the unpacked items and the Trainer integration, naming packing and
the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.errors import CacheError
from tests.conformance.unseen2_data_checks import (
    assert_cache_round_trip,
    kd_teacher_and_lora_student,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


teacher, student = kd_teacher_and_lora_student()
PARAMS = [param for param in student.parameters() if param.requires_grad]


def training_step(batch):  # KD + SFT on a packed batch: no attention mask, position_ids
    with torch.no_grad():
        teacher_logits = teacher(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"]
        ).logits
    outputs = student(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]
    )
    kd = F.kl_div(
        F.log_softmax(outputs.logits, dim=-1),
        F.softmax(teacher_logits / 2.0, dim=-1),
        reduction="batchmean",
    )
    return outputs.loss + 0.5 * kd


def _features(count: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 9, (count,), generator=generator).tolist()
    return [
        {"input_ids": torch.randint(1, 64, (length,), generator=generator).tolist()}
        for length in lengths
    ]


def _packed_loader(count: int = 8, batch_size: int = 3) -> DataLoader:
    collator = transformers.DataCollatorWithFlattening()
    return DataLoader(_features(count), batch_size=batch_size, collate_fn=collator)


def test_packed_batches_are_one_row_with_restarting_positions():
    batch = next(iter(_packed_loader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape[0] == 1
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == 3 and starts[0] == 0


def test_the_packed_row_is_the_sample_and_trains_exactly(tmp_path):
    """Passed as they come, the packed batches are cached a row each (numbered): stage 2 on a
    row trains as the step on that packed batch, loss and gradients bit for bit."""
    batches = list(_packed_loader())
    assert len({batch["input_ids"].shape[1] for batch in batches}) == 3
    split = graphsplit.split(training_step, (dict(batches[0]),))
    assert all(c.ok for c in graphsplit.verify(training_step, split, (dict(batches[1]),)))
    cached = assert_cache_round_trip(split, training_step, batches, tmp_path / "cache", PARAMS)
    assert len(cached) == len(batches)


def test_a_dataloader_over_the_unpacked_items_is_refused_naming_packing(tmp_path):
    """Its rows would be named by dataset index, but a row holds three items."""
    loader = _packed_loader()
    split = graphsplit.split(training_step, (dict(next(iter(loader))),))
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "holds 1 rows but its sampler gave 3 dataset indices" in message
    assert "packs several items into a row" in message
    assert "(batch for batch in loader)" in message
    assert not (tmp_path / "cache" / "manifest.json").exists()


class KDTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = training_step({**inputs})
        return (loss, None) if return_outputs else loss


def test_the_trainer_integration_refuses_a_packing_collator(tmp_path):
    from graphsplit.integrations.transformers import split_trainer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        remove_unused_columns=False,
    )
    trainer = KDTrainer(
        model=student,
        args=args,
        train_dataset=_features(6),
        data_collator=transformers.DataCollatorWithFlattening(),
    )
    with pytest.raises(CacheError) as caught:
        split_trainer(trainer, str(tmp_path / "cache"))
    message = str(caught.value)
    assert "DataCollatorWithFlattening" in message and "packs samples 0 and 1" in message
    assert "input_ids of shape (1, " in message
    assert "padding_free=False" in message and "DataCollatorWithPadding" in message
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
