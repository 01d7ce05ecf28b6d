"""``recompute="auto"`` on the module-level path: stage 2 redoes a cached frozen layer where
its price is below the cache bytes it saves (``calls/recomputed/``).

The module-level path caches a LoRA'd cross-attention's frozen key and value projections of the
text embedding in every block, many times the embedding's bytes; with ``"auto"`` stage 2 runs
those layers on the embedding it reads anyway, priced as the whole-step trace prices a frozen
layer (FLOPs over 4096, held weights over 65536, in bytes per sample). ``"never"`` (the default)
keeps every cached call and the report says what ``"auto"`` would save.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.calls import Verdict
from tests.helpers import split_and_verify
from tests.zoo import SD_SIZES, CaptionedImages
from tests.zoo.sd import build_sd_lora_step


def _sd_batch(first: int, size: int = 2) -> dict[str, torch.Tensor]:
    data = CaptionedImages(length=first + size, resolution=SD_SIZES["tiny"].resolution)
    items = [data[index] for index in range(first, first + size)]
    return {
        name: torch.stack([item[name] for item in items]) for name in ("pixel_values", "input_ids")
    }


def _per_sample(split) -> int:
    return sum(spec.bytes_per_sample for spec in split.boundary.values())


def _verdicts(split, kind: Verdict) -> list[str]:
    return [v.path for v in split.plan.verdicts if v.verdict is kind]


def test_auto_redoes_the_cross_attention_projections_of_the_text_embedding():
    step = build_sd_lora_step(size="tiny")
    never = graphsplit.split(step, kwargs=_sd_batch(0), path="calls")
    auto = split_and_verify(step, (), _sd_batch(0), path="calls", recompute="auto")
    redone = _verdicts(auto, Verdict.RECOMPUTED)
    assert len(redone) == 8 and all(
        path.endswith(("to_k.base_layer", "to_v.base_layer")) for path in redone
    )
    assert not [key for key in auto.boundary if "base_layer" in key]
    assert "text_encoder__0__last_hidden_state" in auto.boundary  # what they compute from
    assert _per_sample(auto) == _per_sample(never) - 20480
    line = next(v.line() for v in auto.plan.verdicts if v.verdict is Verdict.RECOMPUTED)
    assert "20480 bytes per sample not stored, for a price of 88 byte-equivalents" in line
    # Stage 2 holds the base projections it now runs, the VAE and text encoder still not.
    held = {name for name, _ in auto.stage2.named_parameters()}
    assert any(name.endswith("attn2.to_k.base_layer.weight") for name in held)
    assert not any(name.startswith(("vae.", "text_encoder.")) for name in held)
    assert all(c.ok for c in graphsplit.verify(step, auto, kwargs=_sd_batch(2, 3), seed=1))


def test_never_keeps_every_cached_call_and_the_report_says_what_auto_would_save():
    split = graphsplit.split(build_sd_lora_step(size="tiny"), kwargs=_sd_batch(0), path="calls")
    assert not _verdicts(split, Verdict.RECOMPUTED)
    assert len([key for key in split.boundary if "base_layer" in key]) == 8
    assert (
        "recompute='auto' would have stage 2 redo 8 cached frozen layer call(s) computing from "
        "what it reads anyway, storing 20480 fewer bytes per sample"
    ) in split.report()


def test_training_from_a_cache_without_the_projections_is_exact(tmp_path):
    step = build_sd_lora_step(size="tiny")
    reference = copy.deepcopy(step)
    split = graphsplit.split(step, kwargs=_sd_batch(0), path="calls", recompute="auto")
    batches = [_sd_batch(first) for first in (0, 2)]
    rows = [
        {**{k: v[i] for k, v in b.items()}, "key": f"s{n}-{i}"}
        for n, b in enumerate(batches)
        for i in range(2)
    ]
    graphsplit.cache(split, torch.utils.data.DataLoader(rows, batch_size=2), tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert not [name for name in cached[0] if "base_layer" in name]
    trained = [p for p in step.parameters() if p.requires_grad]
    expected_params = [p for p in reference.parameters() if p.requires_grad]
    for first, batch in zip((0, 2), batches):
        torch.manual_seed(first)
        loss = split.stage2(**graphsplit.collate([cached[first], cached[first + 1]]))
        torch.manual_seed(first)
        expected = reference(**batch)
        loss.backward()
        expected.backward()
        assert torch.equal(loss, expected)
        for param, other in zip(trained, expected_params):
            assert torch.equal(param.grad, other.grad)
            param.grad, other.grad = None, None


class Narrows(nn.Module):
    """A frozen encoder (two layers: never redone), a frozen one-layer ``head`` fed by it, and
    the trainable ``out``: what ``head`` reads is what ``narrow`` decides."""

    def __init__(self, width: int, narrow: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, narrow)
        self.encoder.requires_grad_(False)
        self.head.requires_grad_(False)
        self.out = nn.Linear(narrow, 1)

    def forward(self, x):
        return self.out(self.head(self.encoder(x))).square().mean()


def test_a_layer_whose_output_is_smaller_than_its_input_stays_cached():
    """Redoing ``head`` would store the encoder's 64 wide output for its 2 wide one."""
    split = split_and_verify(Narrows(64, 2), (torch.randn(3, 4),), path="calls", recompute="auto")
    assert not _verdicts(split, Verdict.RECOMPUTED)
    assert "head__0__out" in split.boundary and "encoder__0__out" not in split.boundary


def test_a_layer_wider_than_what_it_reads_is_redone_and_the_encoder_stays_cached():
    """``head`` makes 8 wide rows from the encoder's 2 wide ones: stage 2 redoes it on the
    encoder's output, which the cache then stores; the encoder (two layers) is never redone."""
    split = split_and_verify(Narrows(2, 8), (torch.randn(3, 4),), path="calls", recompute="auto")
    assert _verdicts(split, Verdict.RECOMPUTED) == ["head"]
    assert _verdicts(split, Verdict.CACHED) == ["encoder"]
    assert list(split.boundary) == ["x__shape", "encoder__0__out"]


class Widens(nn.Module):
    """One frozen layer on ``x``, which the trainable ``out`` reads too: redoing ``proj`` costs
    no byte, but it is the step's only cacheable call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(2, 64).requires_grad_(False)
        self.out = nn.Linear(64 + 2, 1)

    def forward(self, x):
        return self.out(torch.cat([self.proj(x), x], dim=1)).square().mean()


def test_a_module_level_split_keeps_at_least_one_cached_call():
    split = split_and_verify(Widens(), (torch.randn(3, 2),), path="calls", recompute="auto")
    assert _verdicts(split, Verdict.CACHED) == ["proj"]
    assert "proj__0__out" in split.boundary


@settings(max_examples=8, deadline=None)
@given(width=st.integers(1, 48), narrow=st.integers(1, 48), rows=st.integers(1, 3))
def test_auto_is_exact_and_never_stores_more_than_never(width, narrow, rows):
    step, x = (
        Narrows(width, narrow),
        torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows)),
    )
    never = split_and_verify(step, (x,), path="calls")
    auto = split_and_verify(step, (x,), path="calls", recompute="auto")
    assert _per_sample(auto) <= _per_sample(never)
    assert (_verdicts(auto, Verdict.RECOMPUTED) == ["head"]) == (
        _per_sample(auto) < _per_sample(never)
    )


class OnlyInTheStep(nn.Linear):
    """A layer that runs only inside its step (as a hook wanting the step's state would)."""

    inside = False

    def forward(self, x):
        if not OnlyInTheStep.inside:
            raise RuntimeError("called outside the step")
        return super().forward(x)


class RunsItsLayerInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(4, 2), nn.Tanh()).requires_grad_(False)
        self.head = OnlyInTheStep(2, 32).requires_grad_(False)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        OnlyInTheStep.inside = True
        try:
            return self.out(self.head(self.encoder(x))).square().mean()
        finally:
            OnlyInTheStep.inside = False


def test_a_layer_that_does_not_run_alone_is_priced_out_and_stays_cached():
    split = split_and_verify(
        RunsItsLayerInside(), (torch.randn(3, 4),), path="calls", recompute="auto"
    )
    assert not _verdicts(split, Verdict.RECOMPUTED)
    assert "head__0__out" in split.boundary
