"""A plan per shape signature: one split() and one cache() for a step whose code branches on a
size, exact at every width, a stage-2 process that builds the plans it never saw, and the
max_plans refusal naming the values that vary and the user's line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from graphsplit.errors import SplitError
from graphsplit.runtime import PlanMismatch, check_size
from graphsplit.signatures.signature import SIGNATURE_KEY


class SizeBranch(torch.nn.Module):
    """The issue's size branch: a width that is not a multiple of 16 is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        self.head = torch.nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, pixels, target):
        h = self.encoder(pixels)
        if h.shape[-1] % 16 != 0:
            h = F.pad(h, (0, 1))
        noise = torch.randn_like(target)
        return F.mse_loss(self.head(h).mean(-1) + 0.1 * noise, target)


def _batch(width: int, size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(size, 3, 8, width, generator=generator)
    return {"pixels": pixels, "target": torch.randn(size, 1, 8, generator=generator)}


def _model() -> SizeBranch:
    torch.manual_seed(0)
    return SizeBranch()


def _loss_and_grads(model, compute, seed, batch):
    model.zero_grad()
    torch.manual_seed(seed)
    loss = compute(batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.head.parameters()]


def test_one_split_is_exact_at_both_widths_and_makes_one_plan_per_branch():
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(16, 2, 0))
    for seed, width in enumerate((16, 24, 16, 24, 40)):
        batch = _batch(width, 3, seed)
        got = _loss_and_grads(model, lambda b: split.stage2(**split.stage1(**b)), seed, batch)
        expected = _loss_and_grads(model, lambda b: model(**b), seed, batch)
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    assert [str(s) for s in split.signatures] == [
        "(encoder.shape[-1] % 16) != 0 = false",
        "(encoder.shape[-1] % 16) != 0 = true",
    ]  # width 40 reuses the plan of width 24: only the branch's value makes a plan


def test_a_one_signature_step_keeps_its_code_and_outputs():
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(16, 2, 0))
    code = split.stage1.code
    outputs = split.stage1(**_batch(16, 3, 1))
    assert SIGNATURE_KEY not in outputs and split.stage1.code == code
    assert len(split.plans) == 1


def test_one_cache_over_both_widths_trains_exactly_in_a_process_that_never_saw_width_24(
    tmp_path,
):
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(16, 2, 0))
    samples = [(_batch(width, 2, 10 + i), width) for i, width in enumerate((16, 24, 24, 16, 24))]
    loader = [
        {**batch, "key": [f"{i}-{row}" for row in range(2)]} for i, (batch, _) in enumerate(samples)
    ]
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert len(manifest["plans"]) == 2 and manifest["first_plan"] == split.plans[0].key

    raw = {
        f"{i}-{row}": {name: value[row] for name, value in batch.items()}
        for i, (batch, _) in enumerate(samples)
        for row in range(2)
    }
    fresh = graphsplit.split(model, kwargs=_batch(16, 2, 0))  # a stage-2 process
    cached = graphsplit.CachedDataset(tmp_path / "cache", fresh)
    sampler = cached.loader(batch_size=2, seed=0).batch_sampler
    seen = 0
    for step, indices in enumerate(sampler):
        batch = graphsplit.collate([cached[i] for i in indices])
        keys = [cached.keys[i] for i in indices]
        unsplit = {k: torch.stack([raw[key][k] for key in keys]) for k in ("pixels", "target")}
        got = _loss_and_grads(model, lambda b: fresh.stage2(**b), step, dict(batch))
        expected = _loss_and_grads(model, lambda b: model(**b), step, unsplit)
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
        seen += len(indices)
    assert seen == 10 and len(fresh.plans) == 2  # width 24's plan built from the manifest


def test_a_cache_whose_plan_this_split_plans_differently_names_the_plan_and_the_fix(tmp_path):
    """A cache names its plans by signature key. Where the example a plan was recorded with
    makes another plan here (the cache written by another graphsplit whose keys differ, or
    before the step changed), stage 2 refuses its batches, naming the plan and how to
    rebuild the cache."""
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(16, 2, 0))
    loader = [
        {**_batch(width, 2, i), "key": [f"{i}a", f"{i}b"]} for i, width in enumerate((16, 24))
    ]
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    manifest_file = tmp_path / "cache" / "manifest.json"
    other = split.plans[1].key
    # As a graphsplit that wrote another key for the same plan would have.
    manifest_file.write_text(manifest_file.read_text().replace(other, "0123456789abcdef"))
    fresh = graphsplit.split(model, kwargs=_batch(16, 2, 0))  # a stage-2 process
    cached = graphsplit.CachedDataset(tmp_path / "cache", fresh)
    batch = graphsplit.collate([cached[cached.keys.index(key)] for key in ("1a", "1b")])
    assert batch[SIGNATURE_KEY] == "0123456789abcdef"
    with pytest.raises(SplitError) as caught:
        fresh.stage2(**batch)
    message = str(caught.value)
    assert (
        "rebuilding the plan '0123456789abcdef' from the cache's example made another plan "
        f"({other}: (encoder.shape[-1] % 16) != 0 = true): the cache was written by another "
        "version of graphsplit or of the step" in message
    ), message
    assert "fix:    write the cache again with this graphsplit and step: graphsplit.cache(" in (
        message
    )
    assert "overwrite=True" in message


def test_a_new_plan_with_an_existing_plans_key_is_refused_not_swapped_in(monkeypatch):
    """Two plans with one key would send batches of one to the other's stage 2: a plan made
    for a batch every plan refused must not take a key one of them holds."""
    from graphsplit.signatures.signature import Signature

    monkeypatch.setattr(Signature, "key", property(lambda self: "0" * 16))
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(16, 2, 0))
    with pytest.raises(SplitError) as caught:
        split.stage1(**_batch(24, 2, 1))
    message = str(caught.value)
    assert (
        "the plan made for this batch has the signature key '0000000000000000' of a plan that "
        "refused the batch (this plan was made for (encoder.shape[-1] % 16) != 0 = False, got "
        "True)" in message
    ), message
    assert "This is a graphsplit bug." in message and "if h.shape[-1] % 16 != 0:" in message
    assert "fix:    report it with the step and the two batches' shapes" in message
    assert len(split.plans) == 1


def test_a_mixed_single_plan_cache_records_no_plans(tmp_path):
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(24, 2, 0))
    loader = [
        {**_batch(width, 2, i), "key": [f"{i}a", f"{i}b"]} for i, width in enumerate((24, 40))
    ]
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert "plans" not in manifest and all("signatures" not in s for s in manifest["shards"])


def test_past_max_plans_the_error_names_the_varying_value_and_its_line(tmp_path):
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(16, 2, 0), max_plans=1)
    loader = [
        {**_batch(width, 2, i), "key": [f"{i}a", f"{i}b"]} for i, width in enumerate((16, 24))
    ]
    with pytest.raises(SplitError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert (
        "this plan was made for (encoder.shape[-1] % 16) != 0 = False, got True: the batch needs "
        "a plan of its own, and graphsplit.split has made max_plans=1 plan(s) already "
        "((encoder.shape[-1] % 16) != 0 = false)" in message
    )
    assert "The values that vary between batches: (encoder.shape[-1] % 16) != 0 (at " in message
    assert "if h.shape[-1] % 16 != 0:" in message
    assert "fix:    pass a larger max_plans to graphsplit.split" in message


def test_max_plans_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="max_plans must be a positive integer, got 0"):
        graphsplit.split(_model(), kwargs=_batch(16, 2, 0), max_plans=0)


def test_the_checks_raise_a_typed_signal_carrying_what_differed():
    with pytest.raises(PlanMismatch) as caught:
        check_size(24, 16, "x.shape[-1]", "step.py:3")
    difference = caught.value.difference
    assert (difference.what, difference.expected, difference.actual) == ("x.shape[-1]", 16, 24)
    assert isinstance(caught.value, SplitError)


def test_stage_2_refuses_a_batch_naming_a_plan_it_does_not_know():
    split = graphsplit.split(_model(), kwargs=_batch(16, 2, 0))
    outputs = split.stage1(**_batch(16, 2, 1))
    with pytest.raises(SplitError, match="the batch names the plan 'nope', which this split"):
        split.stage2(**outputs, **{SIGNATURE_KEY: "nope"})
