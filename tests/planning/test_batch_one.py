"""Batch size 1 is first-class: a step whose code runs only at batch 1 splits one sample per batch.

Such steps (DiffSynth-Studio's ``rearrange(..., B=1)``, noise drawn as ``(1, ...)``; it trains
with ``collate_fn=lambda x: x[0]``) fail at the probe sizes 2 and 4. Given a batch-1 example,
graphsplit analyses them at batch 1: every tensor computed from the data is the one sample's,
cached per sample; stage 1 refuses a batch of more than one sample at run time.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.planning.step.example_inputs import ONE_SAMPLE, bind_examples, one_sample_examples
from tests.helpers import boundary_summary, frozen, line_of, split_and_verify


class BatchOneOnly(nn.Module):
    """Frozen encoder, then code that hard-codes the batch size 1, then a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(8, 6))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(x).reshape(1, 2, 3).flatten(1)  # B=1 only, like rearrange(B=1)
        noise = torch.randn(1, 6)
        return nn.functional.mse_loss(self.head(hidden + noise), target)


class AnyBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(8, 6))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.encoder(x)), target)


def one_sample(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 8, generator=generator), torch.randn(1, 6, generator=generator)


def test_a_batch_one_only_step_splits_one_sample_per_batch_and_verifies_exactly():
    step = BatchOneOnly()
    split = split_and_verify(step, one_sample())
    assert boundary_summary(split) == {
        "target": ((1, 6), 0, 24),
        "flatten": ((1, 6), 0, 24),  # the encoder's work, cached per sample
    }
    assert any(
        note.startswith("one sample per batch: the step fails at batch 2") for note in split.notes
    )
    assert split.batch_sizes == (1, 1)  # per-sample figures in the report divide by 1
    assert split.report().startswith(
        "graphsplit plan for BatchOneOnly (traced at batch 1: one sample per batch)"
    )
    for seed in (1, 2):  # the plan holds for other samples
        x, target = one_sample(seed)
        torch.manual_seed(seed)
        expected = step(x, target)
        torch.manual_seed(seed)
        assert torch.equal(split.stage2(**split.stage1(x, target)), expected)


def test_stage1_refuses_a_batch_of_two_samples_at_run_time():
    split = graphsplit.split(BatchOneOnly(), one_sample())
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(torch.randn(2, 8), torch.randn(2, 6))
    message = str(caught.value)
    assert (
        "holds 2 samples (shape (2, 6))" in message or "holds 2 samples (shape (2, 8))" in message
    )
    assert "this plan runs one sample per batch" in message
    assert (
        "fix:" in message and "batch_size=1" in message and "collate_fn=lambda x: x[0]" in message
    )


def test_the_run_time_check_keeps_the_input_names_in_stage1_and_the_cache_keys():
    split = graphsplit.split(BatchOneOnly(), one_sample())
    code = split.stage1.code
    assert "def forward(self, x : _torch_Tensor_, target : _torch_Tensor_):" in code
    assert "check_one_sample(x_batch, 'x')" in code
    assert "target" in split.boundary  # a raw input crossing keeps its own key


def test_a_step_that_runs_at_any_batch_size_keeps_the_general_plan_from_a_batch_one_example():
    split = split_and_verify(AnyBatch(), one_sample())
    assert split.batch_sizes == (2, 4)
    assert not any("one sample per batch" in note for note in split.notes)
    x, target = torch.randn(3, 8), torch.randn(3, 6)  # other batch sizes still run
    assert torch.equal(
        split.stage2(**split.stage1(x, target)), AnyBatch.forward(split._model, x, target)
    )


def test_a_batch_one_only_step_given_a_bigger_example_fails_with_its_own_error():
    x, target = torch.randn(2, 8), torch.randn(2, 6)
    with pytest.raises(graphsplit.TraceError, match="shape '\\[1, 2, 3\\]' is invalid"):
        graphsplit.split(BatchOneOnly(), (x, target), path="trace")


class ReadsAValue(nn.Module):
    """Fails at every batch size: control flow on a value."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # the user's line
            x = x * 2
        return self.head(x).sum()


def test_a_step_that_fails_at_batch_one_too_raises_the_batch_one_error():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(ReadsAValue(), (torch.randn(1, 8),), path="trace")
    assert line_of(ReadsAValue.forward, "if x.sum() > 0") in str(caught.value)


class WithDatasetConstant(nn.Module):
    """A frozen table computed from weights alone, and a sum over the sample (no dim of size 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = frozen(nn.Linear(4, 6))
        self.encoder = frozen(nn.Linear(8, 6))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table(torch.ones(4))  # per-dataset: no data in it
        hidden = self.encoder(x).view(1, 6) + table
        total = hidden.sum()  # 0-dim, from the data: no dim of size 1 to cache it along
        return (self.head(hidden) * total).reshape(1, 6).mean()


def test_constants_are_stored_once_and_a_data_tensor_without_a_unit_dim_is_not_cached():
    split = split_and_verify(WithDatasetConstant(), (torch.randn(1, 8),))
    assert any("one sample per batch" in note for note in split.notes)
    specs = split.boundary.values()
    assert all(spec.shape != () for spec in specs)  # the 0-dim sum is recomputed in stage 2
    assert all(spec.batch_dim == 0 or spec.bytes_per_sample == 0 for spec in specs)


def test_one_sample_examples_are_the_example_itself_at_batch_one():
    step = BatchOneOnly()
    x, target = one_sample()
    examples = bind_examples(step, (x, target), {})
    assert examples.batch_sizes == (2, 4)
    one = one_sample_examples(examples)
    assert one.batch_sizes == ONE_SAMPLE
    assert one.values[0]["x"].shape == (1, 8) and one.values[0]["x"].is_meta
    bigger = bind_examples(step, (torch.randn(3, 8), torch.randn(3, 6)), {})
    with pytest.raises(graphsplit.SplitError, match="needs a batch-1 example; this one has 3 rows"):
        one_sample_examples(bigger)


def test_a_batch_one_cache_trains_stage2_exactly(tmp_path):
    step = BatchOneOnly()
    samples = [one_sample(seed) for seed in range(3)]
    split = graphsplit.split(step, samples[0])
    loader = [{"x": x, "target": target, "key": [f"s{i}"]} for i, (x, target) in enumerate(samples)]
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    dataset = graphsplit.CachedDataset(tmp_path / "cache", split=split)
    assert len(dataset) == 3
    for index, (x, target) in enumerate(samples):
        cached = graphsplit.collate([dataset[index]])  # one sample per batch
        torch.manual_seed(index)
        from_cache = split.stage2(**cached)
        torch.manual_seed(index)
        assert torch.equal(from_cache, step(x, target))


class PerSampleEncoder(nn.Module):
    """Encodes one sample at a time, like DiffSynth's ``WanVideoVAE.encode``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 6)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.linear(row) for row in x])


class LoopsOverTheBatch(nn.Module):
    """Frozen work that loops over the batch inside a module's method.

    It runs at every batch size, but the probe runs see different ops at batch 2 and 4, so the
    general plan keeps the encoder in stage 2; at batch 1 it is cached.
    """

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(PerSampleEncoder())
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder.encode(x)).mean()


def test_frozen_work_judged_mixing_at_the_probe_sizes_is_cached_one_sample_per_batch():
    step = LoopsOverTheBatch()
    split = split_and_verify(step, (torch.randn(1, 8),))
    note = next(note for note in split.notes if note.startswith("one sample per batch"))
    assert "looked like mixing samples and would have run every step" in note
    assert "pass an example of 2 samples for a plan for every batch size" in note
    assert [spec.shape for spec in split.boundary.values()] == [(1, 6)]  # the encoder's output
    general = split_and_verify(step, (torch.randn(2, 8),))  # 2 samples: the general plan
    assert not any("one sample per batch" in note for note in general.notes)
    assert list(general.boundary) == ["x"]


def test_saved_stage1_code_keeps_the_one_sample_check(tmp_path):
    import importlib.util

    split = graphsplit.split(BatchOneOnly(), one_sample())
    folder = split.save_code(tmp_path / "code")
    spec = importlib.util.spec_from_file_location("saved_stage1", folder / "stage1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stage1 = module.Stage1(split.stage1)
    x, target = one_sample()
    saved, live = stage1(x, target), split.stage1(x, target)
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in live)
    with pytest.raises(graphsplit.SplitError, match="this plan runs one sample per batch"):
        stage1(torch.randn(2, 8), torch.randn(2, 6))


class BatchOneCat(nn.Module):
    """``torch.cat`` of a batch with a ``(1, ...)`` tensor: torch's fake mode logs the failure."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(8, 6))
        self.head = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hidden = torch.cat([self.encoder(x), torch.randn(1, 6)], dim=1)  # B=1 only
        return nn.functional.mse_loss(self.head(hidden), target)


def test_the_expected_failure_at_the_probe_sizes_leaves_no_error_in_the_log(caplog):
    with caplog.at_level("DEBUG"):
        split = split_and_verify(BatchOneCat(), one_sample())
    assert split.batch_sizes == (1, 1)
    assert [record for record in caplog.records if record.levelname == "ERROR"] == []
