"""Store or recompute (``split(..., recompute=)``): which frozen work stage 2 redoes, exactly.

Every split here is checked bit for bit against the step (``split_and_verify``, and again at a
second batch size), and the tests assert which parameters stage 2 holds: recomputing a frozen
layer is only right if stage 2 then holds that layer's weights, and only those.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

import graphsplit
from graphsplit.errors import SplitError
from graphsplit.planning.cut.boundary import choose_boundary
from graphsplit.planning.cut.recompute import AUTO, CostModel, candidates
from tests.helpers import (
    batch,
    boundary_summary,
    frozen,
    line_of,
    param_names,
    split_and_verify,
    stage2_names,
)


def verify_at(model: nn.Module, split: graphsplit.Split, *args: torch.Tensor) -> None:
    """Exact at another batch size than the one the plan was traced at."""
    comparisons = graphsplit.verify(model, split, args)
    assert comparisons and all(comparison.ok for comparison in comparisons)


def labels(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 10, (size,), generator=torch.Generator().manual_seed(seed))


# -- a LoRA'd linear: the frozen base projection is 8x the bytes of its input -------------------
class LoraProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, tokens, target):
        return F.mse_loss(self.head(torch.tanh(self.proj(tokens))).squeeze(-1), target)


def lora_projection() -> LoraProjection:
    torch.manual_seed(0)
    model = LoraProjection()
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["proj"], init_lora_weights="gaussian")
    inject_adapter_in_model(config, model)
    with torch.no_grad():  # peft starts lora_B at zero, which would zero lora_A's gradient
        model.proj.lora_B["default"].weight.normal_(std=0.1)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name or name.startswith("head."))
    return model


def lora_batch(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(size, 4, 8, seed=seed), batch(size, 4, seed=seed + 1)


BASE = {"proj.base_layer.weight", "proj.base_layer.bias"}
LORA = {"proj.lora_A.default.weight", "proj.lora_B.default.weight"}


def test_lora_base_projection_is_cached_with_never_the_default():
    model = lora_projection()
    split = split_and_verify(model, lora_batch(3))
    # The tokens cross as the output of lora_dropout (an identity here: same bytes, and one
    # node fewer for stage 2 to run).
    assert boundary_summary(split) == {
        "target": ((3, 4), 0, 16),
        "proj_base_layer": ((3, 4, 64), 0, 1024),
        "proj_lora_dropout_default": ((3, 4, 8), 0, 128),
    }
    assert param_names(split.stage2, model) == LORA | {"head.weight", "head.bias"}
    assert split.cut.recomputation is None
    verify_at(model, split, *lora_batch(5, seed=4))


def test_lora_base_projection_is_recomputed_with_auto():
    model = lora_projection()
    split = split_and_verify(model, lora_batch(3), recompute="auto")
    # The tokens cross anyway (lora_A reads them): redoing the base projection saves 1 KiB
    # per sample for 1 KFLOP and 2.25 KiB of weights held once.
    assert boundary_summary(split) == {"tokens": ((3, 4, 8), 0, 128), "target": ((3, 4), 0, 16)}
    assert param_names(split.stage2, model) == BASE | LORA | {"head.weight", "head.bias"}
    assert param_names(split.stage1, model) == set()
    assert split.stage2.proj.base_layer is model.proj.base_layer
    trade = split.cut.recomputation
    assert [node.name for node in trade.nodes] == ["proj_base_layer"]
    assert trade.bytes_saved_per_sample == 1024
    assert trade.flops_per_sample == 2 * 4 * 8 * 64
    assert trade.weights == ("proj.base_layer.bias", "proj.base_layer.weight")
    assert trade.weight_bytes == (64 * 8 + 64) * 4
    verify_at(model, split, *lora_batch(5, seed=4))
    # Frozen weights still get no gradient; the adapter's do.
    split.stage2(**split.stage1(*lora_batch(3))).backward()
    assert model.proj.base_layer.weight.grad is None
    assert model.proj.lora_A["default"].weight.grad is not None


def test_report_and_plan_show_the_trade():
    model = lora_projection()
    split = graphsplit.split(model, lora_batch(3), recompute="auto")
    report = split.report()
    assert 'Frozen work stage 2 redoes instead of caching it (recompute="auto"):' in report
    assert "proj_base_layer" in report and "proj.base_layer" in report
    assert "saves 1.0 KiB per sample of cache; costs 4.1 KFLOP per sample" in report
    assert "2.2 KiB of frozen weights stage 2 now holds (2 tensors)" in report
    assert "    proj.base_layer: bias, weight\n" in report
    plan = json.loads(json.dumps(split.to_json()))
    assert plan["recomputed"] == {
        "nodes": [
            {
                "node": "proj_base_layer",
                "runs": "proj.base_layer",
                "source": split.cut.recomputation.nodes[0].meta["source"],
            }
        ],
        "bytes_saved_per_sample": 1024,
        "flops_per_sample": 4096,
        "weights": ["proj.base_layer.bias", "proj.base_layer.weight"],
        "weight_bytes": 2304,
    }
    never = graphsplit.split(model, lora_batch(3))
    assert "redoes" not in never.report() and never.to_json()["recomputed"] is None


# -- label embeddings: cheap to recompute, big to store -----------------------------------------
class LabelConditioned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.label_embedding = frozen(nn.Embedding(10, 32))
        self.denoiser = nn.Linear(32, 32)

    def forward(self, latents, labels):
        condition = self.label_embedding(labels)
        return (self.denoiser(latents + condition) - latents).pow(2).mean()


def test_label_embedding_lookup_is_recomputed_from_the_labels():
    model = LabelConditioned()
    split = split_and_verify(model, (batch(3, 32), labels(3)), recompute="auto")
    # 8 B of label per sample instead of 128 B of embedding; the lookup runs no FLOPs.
    assert boundary_summary(split) == {"latents": ((3, 32), 0, 128), "labels": ((3,), 0, 8)}
    assert param_names(split.stage2, model) == {
        "label_embedding.weight",
        "denoiser.weight",
        "denoiser.bias",
    }
    trade = split.cut.recomputation
    assert [node.name for node in trade.nodes] == ["label_embedding"]
    assert (
        trade.nodes[0]
        .meta["source"]
        .endswith(line_of(LabelConditioned.forward, "self.label_embedding("))
    )
    assert (trade.bytes_saved_per_sample, trade.flops_per_sample) == (120, 0)
    assert (trade.weights, trade.weight_bytes) == (("label_embedding.weight",), 10 * 32 * 4)
    verify_at(model, split, batch(5, 32, seed=2), labels(5, seed=3))


def test_label_embedding_is_cached_with_never():
    model = LabelConditioned()
    split = split_and_verify(model, (batch(3, 32), labels(3)), recompute="never")
    assert boundary_summary(split) == {"latents": ((3, 32), 0, 128), "add": ((3, 32), 0, 128)}
    assert param_names(split.stage2, model) == {"denoiser.weight", "denoiser.bias"}
    verify_at(model, split, batch(5, 32, seed=2), labels(5, seed=3))


# -- the exchange rate: bytes saved against FLOPs and weights -----------------------------------
class FrozenSummaryBesideTrainable(nn.Module):
    """A frozen and a trainable projection of the same input; the input crosses anyway."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.summary = frozen(nn.Linear(width, 2))
        self.trainable = nn.Linear(width, 2)

    def forward(self, x):
        return torch.cat([self.summary(x), self.trainable(x)], dim=1).pow(2).mean()


def test_a_cheap_frozen_layer_is_recomputed():
    model = FrozenSummaryBesideTrainable(16)
    split = split_and_verify(model, (batch(3, 16),), recompute="auto")
    # Saves 8 B per sample; costs ceil(64 FLOP / 4096) + ceil(136 B / 65536) = 2.
    assert boundary_summary(split) == {"x": ((3, 16), 0, 64)}
    assert "summary" in stage2_names(split)
    assert param_names(split.stage2, model) >= {"summary.weight", "summary.bias"}


def test_a_frozen_layer_whose_flops_outweigh_the_bytes_is_stored():
    model = FrozenSummaryBesideTrainable(16384)
    split = split_and_verify(model, (batch(3, 16384),), recompute="auto")
    # Would save 8 B per sample; costs ceil(65536 FLOP / 4096) + ceil(131080 B / 65536) = 19.
    assert boundary_summary(split) == {"x": ((3, 16384), 0, 65536), "summary": ((3, 2), 0, 8)}
    assert param_names(split.stage2, model) == {"trainable.weight", "trainable.bias"}
    assert split.cut.recomputation is None


def test_the_exchange_rates_are_whole_byte_equivalents():
    assert (AUTO.flops_per_byte, AUTO.weight_samples) == (4096, 65536)
    assert [AUTO.work_cost(flops) for flops in (0, 1, 4096, 4097)] == [0, 1, 1, 2]
    assert [AUTO.weight_cost(size) for size in (0, 136, 65536, 131080)] == [0, 1, 1, 3]


def test_a_dearer_exchange_rate_keeps_the_base_projection_cached():
    model = lora_projection()
    graph_source = graphsplit.split(model, lora_batch(3), recompute="never")
    dear = CostModel(flops_per_byte=1, weight_samples=1)  # 1 FLOP costs as much as 1 byte
    cut = choose_boundary(
        graph_source.graph, graph_source.trainable, recompute="auto", model=model, costs=dear
    )
    assert [node.name for node in cut.boundary] == [n.name for n in graph_source.cut.boundary]
    assert cut.recomputation is None


# -- what is never recomputed -------------------------------------------------------------------
class FrozenEncoderOnRawInput(nn.Module):
    """A whole (tiny) encoder: cheap to redo at this size, but a model, not a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 64)))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


def test_a_whole_frozen_encoder_is_never_recomputed():
    model = FrozenEncoderOnRawInput()
    split = split_and_verify(model, (batch(3, 4),), recompute="auto")
    assert boundary_summary(split) == {"encoder": ((3, 64), 0, 256)}
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}
    assert split.cut.recomputation is None


class FrozenChainOnRawInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = frozen(nn.Linear(4, 8))
        self.second = frozen(nn.Linear(8, 64))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.second(torch.tanh(self.first(x)))).mean()


def test_a_layer_whose_input_only_frozen_work_reads_is_not_recomputed():
    model = FrozenChainOnRawInput()
    split = split_and_verify(model, (batch(3, 4),), recompute="auto")
    # Storing x (16 B) and redoing both layers would be cheaper by the prices, but ``second``
    # reads a value stage 2 would not otherwise have: chains of frozen work stay in stage 1.
    graph = split.graph
    assert {node.name for node in candidates(graph, split.cut.taint)} == {"first"}
    assert boundary_summary(split) == {"second": ((3, 64), 0, 256)}
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}


class FrozenLayerOnNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = frozen(nn.Linear(4, 64))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.frozen(x + torch.randn_like(x))).mean()


def test_frozen_work_on_random_values_runs_in_stage2_and_is_no_trade():
    model = FrozenLayerOnNoise()
    split = split_and_verify(model, (batch(3, 4),), recompute="never")
    assert "frozen" in stage2_names(split)  # random-tainted: stage 2 whatever the mode
    assert split.cut.recomputation is None
    assert "redoes" not in split.report()


def test_an_unknown_recompute_choice_is_refused_before_tracing():
    class Untraceable(nn.Module):
        def forward(self, x):
            raise AssertionError("split must refuse recompute= before running the step")

    with pytest.raises(SplitError) as caught:
        graphsplit.split(Untraceable(), (batch(3, 4),), recompute="always")
    message = str(caught.value)
    assert "recompute='always' is not a choice" in message
    assert 'fix:    pass recompute="never"' in message and 'recompute="auto"' in message


class FrozenLayerOnAFoldedBatch(nn.Module):
    """A fold (as for classifier-free guidance) before a frozen layer: its output has 2B rows."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = frozen(nn.Linear(4, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        doubled = torch.cat([x, torch.zeros_like(x)])
        return self.head(self.frozen(doubled)).mean()


def test_redoing_a_frozen_layer_can_be_the_only_exact_split():
    model = FrozenLayerOnAFoldedBatch()
    with pytest.raises(SplitError, match="does not hold one row per sample"):
        graphsplit.split(model, (batch(3, 4),), recompute="never", path="trace")
    split = split_and_verify(model, (batch(3, 4),), recompute="auto")
    assert boundary_summary(split) == {"x": ((3, 4), 0, 16)}
    trade = split.cut.recomputation
    assert [node.name for node in trade.nodes] == ["frozen"]
    assert trade.bytes_saved_per_sample is None
    assert trade.weights == ("frozen.bias", "frozen.weight")
    assert 'makes the split possible (recompute="never" finds no exact one)' in split.report()
    assert split.to_json()["recomputed"]["bytes_saved_per_sample"] is None
    verify_at(model, split, batch(5, 4, seed=1))
