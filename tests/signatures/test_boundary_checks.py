"""Stage 2's size checks of boundary tensors run in stage 1 (graphsplit/signatures/boundary_checks):
a batch the plan's stage 2 would refuse gets a plan of its own before any row of it is cached,
or, past ``max_plans``, is refused by ``cache()`` naming the user's line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from graphsplit.errors import SplitError
from graphsplit.signatures.boundary_checks import SizeChecks
from graphsplit.tools.picture_page import to_html
from tests.signatures.epoch import epoch_exact


class NoisyPackedWidth(torch.nn.Module):
    """FLUX's packing in small, its width scaled by a float: ``int()`` of a float computed from
    a size of a tensor stage 2 computes (the latents are drawn in stage 2) is a literal of the
    plan (``int()`` of an int size stays traced, planning/tracing/int_calls.py), checked in
    stage 2, never in stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, pixels, target):
        h = self.encoder(pixels)
        h = h + 0.1 * torch.randn_like(h)
        width = int(h.shape[-1] * 2.0)
        packed = h.view(h.shape[0], 4, -1).transpose(1, 2)
        out = self.head(packed).transpose(1, 2).reshape(h.shape[0], 4, 8, width // 2)
        return F.mse_loss(out.mean(1), target)


def _batch(width: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "pixels": torch.randn(2, 3, 8, width, generator=generator),
        "target": torch.randn(2, 8, width, generator=generator),
    }


def _split(**options) -> tuple[NoisyPackedWidth, graphsplit.Split]:
    torch.manual_seed(0)
    model = NoisyPackedWidth()
    return model, graphsplit.split(model, kwargs=_batch(16, 0), **options)


def test_the_check_is_stage_2s_and_stage_1_runs_it_on_the_boundary_it_made():
    _, split = _split()
    assert "graphsplit_runtime_check_size_read(" in split.stage2.code
    assert "graphsplit_runtime_check_size_read(" not in split.stage1.code
    checks = SizeChecks.of(split.plans[0].stage2)
    assert checks is not None and len(checks.checks) == 1
    assert "self.head" not in checks.checks[0].module.code  # no weight read
    state = torch.get_rng_state()
    split.stage1(**_batch(24, 1))
    assert torch.equal(torch.get_rng_state(), state)  # the meta run drew nothing
    assert [plan.signature.as_dict() for plan in split.plans] == [
        {"int((encoder + (0.1 * randn_like)).shape[-1] * 2.0)": 32},
        {"int((encoder + (0.1 * randn_like)).shape[-1] * 2.0)": 48},
    ]


def test_one_cache_over_both_widths_trains_exactly(tmp_path):
    model, split = _split()
    batches = [_batch(width, seed) for seed, width in enumerate((16, 24, 24, 16), start=1)]
    result = epoch_exact(model, split, batches, tmp_path / "cache", batch_size=2)
    assert {shape["pixels"][3] for shape in result.shapes} == {16, 24}
    assert len(result.cached.manifest.plans) == 2


def test_past_max_plans_cache_refuses_the_batch_before_writing_it(tmp_path):
    _, split = _split(max_plans=1)
    loader = [
        {**_batch(width, seed), "key": [f"{seed}a", f"{seed}b"]}
        for seed, width in enumerate((16, 24))
    ]
    with pytest.raises(SplitError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    message = str(caught.value)
    what = "int((encoder + (0.1 * randn_like)).shape[-1] * 2.0)"
    assert f"this plan was made for {what} = 32, got 48" in message
    assert "width = int(h.shape[-1] * 2.0)" in message
    assert "fix:    pass a larger max_plans to graphsplit.split" in message
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_the_report_plan_json_and_picture_list_the_signatures(tmp_path):
    _, split = _split()
    split.stage1(**_batch(24, 1))
    report = split.report()
    assert "Shape signatures (2 plan(s) of max_plans=8" in report
    what = "int((encoder + (0.1 * randn_like)).shape[-1] * 2.0)"
    assert f"    {what}  tests/signatures/test_boundary_checks.py:" in report
    assert ": the check at test_boundary_checks.py:" in report
    assert " (width = int(h.shape[-1] * 2.0)) = 48\n" in report
    entries = json.loads(json.dumps(split.to_json()))["signatures"]
    assert [entry["checks"][0]["expected"] for entry in entries] == [32, 48]
    assert [entry["first"] for entry in entries] == [True, False]
    assert entries[1]["key"] == split.plans[1].key
    page = to_html(split)
    assert "<h2>Shape signatures</h2>" in page and f"<td>{split.plans[1].key}</td>" in page


def test_a_split_without_size_checks_lists_no_signatures():
    step = torch.nn.Sequential(torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Linear(4, 1))
    split = graphsplit.split(step, (torch.randn(2, 4),))
    assert "Shape signatures" not in split.report()
    assert split.to_json()["signatures"] == []
    assert "Shape signatures" not in to_html(split)
