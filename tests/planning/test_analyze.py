"""What ``planning.analyze`` finds on synthetic steps: random draws and samples mixed in frozen
code stay in stage 2 (with the report saying why), inactive ones are cached.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphsplit.artifacts import TaintKind
from graphsplit.planning.cut.boundary import facts
from tests.helpers import (
    batch,
    boundary_summary,
    frozen,
    line_of,
    node_named,
    param_names,
    split_and_verify,
    stage2_names,
)


# -- randomness ---------------------------------------------------------------------------------
class NoiseAndTimesteps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        latents = self.encoder(x)
        noise = torch.randn_like(latents)
        steps = torch.randint(0, 10, (latents.shape[0],), device=latents.device)
        noisy = latents + noise * steps[:, None]
        return F.mse_loss(self.head(noisy), noise)


def test_random_draws_stay_in_stage2_in_order():
    model = NoiseAndTimesteps()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"encoder": ((3, 4), 0, 16)}
    assert {"randn_like", "randint"} <= stage2_names(split)
    code = split.stage2.code
    assert code.index("torch.randn_like(") < code.index("torch.randint(")
    report = split.report()
    assert "Random draws kept in stage 2" in report
    for name, text in (("randn_like", "torch.randn_like("), ("randint", "torch.randint(")):
        row = next(line for line in report.splitlines() if line.strip().startswith(name + " "))
        assert row.rstrip().endswith(line_of(NoiseAndTimesteps.forward, text))


class UnusedDrawBeforeUsedDraw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        latents = self.encoder(x)
        torch.randn_like(latents)  # result unused, but it advances the generator
        noise = torch.randn_like(latents)
        return self.head(latents + noise).mean()


def test_unused_random_draw_still_happens_in_stage2():
    model = UnusedDrawBeforeUsedDraw()
    split = split_and_verify(model, (batch(3, 4),))
    assert {"randn_like", "randn_like_1"} <= stage2_names(split)


class AugmentBeforeFrozenEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        augmented = x + 0.1 * torch.randn_like(x)
        return self.head(self.encoder(augmented)).mean()


def test_random_augmentation_before_a_frozen_encoder_caches_nothing_after_it():
    model = AugmentBeforeFrozenEncoder()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"x": ((3, 4), 0, 16)}
    assert {"randn_like", "encoder"} <= stage2_names(split)
    assert split.cut.taint[node_named(split, "encoder")].kind is TaintKind.RANDOM
    assert param_names(split.stage1, model) == set()


class FrozenEncoderWithDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.encoder = frozen(nn.Sequential(nn.Linear(4, 4), nn.Dropout(p)))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


def test_active_dropout_in_a_frozen_module_is_not_cached_and_the_report_says_why():
    model = FrozenEncoderWithDropout(0.5)
    split = split_and_verify(model, (batch(3, 4),))
    assert list(split.boundary) == ["x"]
    assert "encoder" in stage2_names(split)
    assert split.cut.taint[node_named(split, "encoder")].kind is TaintKind.RANDOM
    report = split.report()
    not_cached = report.split("Not cached", 1)[1]
    assert "encoder" in not_cached and "random" in not_cached
    assert "encoder.eval()" in not_cached
    first_row = not_cached.splitlines()[1].rstrip()
    assert first_row.endswith(line_of(FrozenEncoderWithDropout.forward, "self.encoder("))


@pytest.mark.parametrize("variant", ["p=0", "eval"])
def test_inactive_dropout_in_a_frozen_module_is_cached(variant):
    model = FrozenEncoderWithDropout(0.0 if variant == "p=0" else 0.5)
    if variant == "eval":
        model.encoder.eval()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"encoder": ((3, 4), 0, 16)}
    assert stage2_names(split) == {"head", "mean"}
    assert "Not cached" not in split.report()


class FrozenAttention(nn.Module):
    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        self.qkv = frozen(nn.Linear(8, 24))
        self.head = nn.Linear(8, 1)

    def forward(self, tokens):
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)
        return self.head(attended).mean()


def test_attention_without_dropout_is_cached():
    model = FrozenAttention(0.0)
    split = split_and_verify(model, (batch(3, 5, 8),))
    assert boundary_summary(split) == {"scaled_dot_product_attention": ((3, 5, 8), 0, 160)}
    assert stage2_names(split) == {"head", "mean"}
    assert "Random draws" not in split.report()


def test_attention_with_dropout_is_random_and_runs_in_stage2():
    model = FrozenAttention(0.25)
    split = split_and_verify(model, (batch(3, 5, 8),))
    assert "scaled_dot_product_attention" in stage2_names(split)
    assert "qkv" not in stage2_names(split)  # the projection is still cached
    assert (
        split.cut.taint[node_named(split, "scaled_dot_product_attention")].kind is TaintKind.RANDOM
    )
    assert "Random draws kept in stage 2" in split.report()


# -- samples mixed in frozen code ---------------------------------------------------------------
class FrozenBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


def test_frozen_batchnorm_in_train_mode_is_not_cached_and_the_report_says_why():
    model = FrozenBatchNorm()
    split = split_and_verify(model, (batch(3, 4),))
    assert list(split.boundary) == ["x"]
    assert "encoder" in stage2_names(split)
    assert split.cut.taint[node_named(split, "encoder")].kind is TaintKind.MIXING
    not_cached = split.report().split("Not cached", 1)[1]
    assert "BatchNorm" in not_cached
    assert "encoder.eval()" in not_cached


def test_frozen_batchnorm_in_eval_mode_is_cached():
    model = FrozenBatchNorm()
    model.encoder.eval()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"encoder": ((3, 4), 0, 16)}
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}


class CenterOverBatch(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class FrozenCentering(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.center = CenterOverBatch()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        latents = self.encoder(x)
        return self.head(self.center(latents)).mean()


def test_reduction_over_the_batch_in_frozen_code_is_not_cached():
    model = FrozenCentering()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"encoder": ((3, 4), 0, 16)}
    assert {"mean", "sub"} <= stage2_names(split)
    assert split.cut.taint[node_named(split, "sub")].kind is TaintKind.MIXING
    not_cached = split.report().split("Not cached", 1)[1]
    assert "mean" in not_cached and "mixes samples" in not_cached
    assert line_of(CenterOverBatch.forward, "x.mean(0)") in not_cached


class NewZerosFromData(nn.Module):
    """``x.new_zeros(())`` reads only x's dtype and device: it is not data of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        latents = self.encoder(x)
        total = latents.new_zeros(())
        padding = torch.zeros_like(latents)
        return self.head(latents + padding).mean() + total


def test_new_zeros_and_zeros_like_of_data_do_not_mix_samples():
    split = split_and_verify(NewZerosFromData(), (torch.randn(3, 4),))
    assert not any(facts(node).mixing for node in split.graph.nodes if node.op != "output")
    assert "self.encoder" not in split.stage2.code


class ConstantTypedAsData(nn.Module):
    """VideoMAE's embeddings: a constant cast with ``type_as`` (and ``.to``, ``expand_as``)
    the batch's tensor, then added to it, then a second frozen layer: the cast reads only the
    dtype, so the constant stays a constant and both frozen layers are cached."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("positions", torch.randn(4))
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        embeddings = self.patches(x)
        embeddings = embeddings + self.positions.detach().type_as(embeddings)
        embeddings = embeddings * self.positions.to(embeddings).expand_as(embeddings)
        return self.head(self.encoder(embeddings)).mean()


def test_type_as_and_to_of_data_read_only_its_dtype():
    split = split_and_verify(ConstantTypedAsData(), (torch.randn(3, 4),))
    assert not any(facts(node).mixing for node in split.graph.nodes if node.op != "output")
    assert boundary_summary(split) == {"encoder": ((3, 4), 0, 16)}
