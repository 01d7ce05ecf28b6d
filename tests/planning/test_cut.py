"""Where ``planning.cut`` puts the boundary, on synthetic steps split end to end.

Every test checks exactness bit for bit (``split_and_verify``) and what the plan says: the
boundary's names, shapes and batch dims, which parameters each stage holds and which nodes stage 2
recomputes (graph shapes, shared modules, shape values, per-dataset constants, banned work).
Tests about the rule that frozen work stays in stage 1 pass ``recompute="never"``; what
``recompute="auto"`` trades instead is in ``test_recompute.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphsplit.artifacts import TaintKind
from graphsplit.planning.cut.boundary import facts, is_banned
from tests.helpers import (
    batch,
    boundary_summary,
    frozen,
    line_of,
    node_named,
    param_names,
    split_and_verify,
    stage1_names,
    stage2_names,
)


# -- graph shapes -------------------------------------------------------------------------------
class FrozenChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = frozen(nn.Linear(8, 16))
        self.second = frozen(nn.Linear(16, 6))
        self.head = nn.Linear(6, 1)

    def forward(self, x, y):
        hidden = torch.tanh(self.first(x))
        features = self.second(hidden)
        return F.mse_loss(self.head(features), y)


def test_chain_caches_the_end_of_the_frozen_chain():
    model = FrozenChain()
    split = split_and_verify(model, (batch(3, 8), batch(3, 1, seed=1)))
    assert boundary_summary(split) == {"y": ((3, 1), 0, 4), "second": ((3, 6), 0, 24)}
    assert split.boundary["second"].source.endswith(line_of(FrozenChain.forward, "self.second("))
    assert param_names(split.stage1, model) == {
        "first.weight",
        "first.bias",
        "second.weight",
        "second.bias",
    }
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}
    assert stage2_names(split) == {"head", "mse_loss"}


class Diamond(nn.Module):
    """x -> a -> (tanh, b) -> add -> head: the join is the single cheapest cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = frozen(nn.Linear(4, 8))
        self.b = frozen(nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        hidden = self.a(x)
        joined = torch.tanh(hidden) + self.b(hidden)
        return self.head(joined).mean()


def test_diamond_is_cut_at_the_join():
    model = Diamond()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"add": ((3, 8), 0, 32)}
    assert stage1_names(split) == {"x", "a", "tanh", "b", "add"}
    assert stage2_names(split) == {"head", "mean"}
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}


class SkipConnections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = frozen(nn.Linear(4, 4))
        self.b = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        hidden = self.a(x)
        residual = self.b(torch.tanh(hidden)) + hidden
        return self.head(residual + x).sum()


def test_skip_connections_from_the_input_are_cut_after_they_join():
    model = SkipConnections()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"add_1": ((3, 4), 0, 16)}
    assert "x" not in split.boundary
    assert stage2_names(split) == {"head", "sum_1"}
    assert not param_names(split.stage2, model) & {"a.weight", "b.weight"}


class TrainableSkipAroundFrozen(nn.Module):
    """A trainable branch beside a frozen one: both read x, so x and the frozen output cross."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 8))
        self.adapter = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(x) + self.adapter(x)).mean()


def test_trainable_branch_beside_frozen_branch_keeps_both_inputs():
    model = TrainableSkipAroundFrozen()
    split = split_and_verify(model, (batch(3, 4),), recompute="never")
    assert boundary_summary(split) == {"x": ((3, 4), 0, 16), "encoder": ((3, 8), 0, 32)}
    assert param_names(split.stage1, model) == {"encoder.weight", "encoder.bias"}
    assert "encoder" not in {name.split(".")[0] for name in param_names(split.stage2, model)}
    # x crosses anyway, so "auto" redoes the small frozen layer instead of storing its output.
    split = split_and_verify(model, (batch(3, 4),), recompute="auto")
    assert boundary_summary(split) == {"x": ((3, 4), 0, 16)}
    assert {"encoder.weight", "encoder.bias"} <= param_names(split.stage2, model)


# -- shared and repeated frozen modules ---------------------------------------------------------
class FrozenProjectionUsedByBothStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.projection = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        features = self.projection(x)
        return self.projection(self.head(features)).pow(2).mean()


def test_frozen_module_used_by_both_stages_is_the_same_object_in_both():
    model = FrozenProjectionUsedByBothStages()
    split = split_and_verify(model, (batch(3, 4),))
    assert list(split.boundary) == ["projection"]
    assert stage2_names(split) == {"head", "projection_1", "pow_1", "mean"}
    assert split.stage1.projection is model.projection
    assert split.stage2.projection is model.projection
    assert param_names(split.stage1, model) == {"projection.weight", "projection.bias"}
    assert param_names(split.stage2, model) == {
        "projection.weight",
        "projection.bias",
        "head.weight",
        "head.bias",
    }
    # The second call depends on the trainable head: tainted, never cached.
    assert split.cut.taint[node_named(split, "projection_1")].kind is TaintKind.TRAINABLE


class FrozenModuleCalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.encoder(self.encoder(x))), y)


def test_frozen_module_called_twice_runs_twice_in_stage1():
    model = FrozenModuleCalledTwice()
    split = split_and_verify(model, (batch(3, 4), batch(3, 1, seed=1)))
    assert list(split.boundary) == ["y", "encoder_1"]
    assert {"encoder", "encoder_1"} <= stage1_names(split)
    assert "self.encoder(" not in split.stage2.code
    assert split.stage1.code.count("self.encoder(") == 2
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}


class TrainableBeforeFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Linear(4, 4)
        self.encoder = frozen(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)))

    def forward(self, x):
        return self.encoder(self.adapter(x)).pow(2).mean()


def test_gradient_through_frozen_code_caches_nothing_after_the_trainable_parameter():
    model = TrainableBeforeFrozen()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"x": ((3, 4), 0, 16)}
    assert param_names(split.stage1, model) == set()
    assert param_names(split.stage2, model) == {name for name, _ in model.named_parameters()}
    assert split.cut.taint[node_named(split, "encoder")].kind is TaintKind.TRAINABLE
    # Frozen weights still receive no gradient, trainable ones do, exactly as in the model.
    split.stage2(**split.stage1(batch(3, 4))).backward()
    assert model.adapter.weight.grad is not None and model.encoder[0].weight.grad is None


# -- shapes and Python values -------------------------------------------------------------------
class ShapeValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Conv2d(2, 3, 3, padding=1))
        self.head = nn.Linear(48, 8)

    def forward(self, images):
        features = self.encoder(images).view(images.shape[0], -1)
        out = self.head(features)
        return out.view(features.shape[0], 2, 4).pow(2).mean()


def test_shape_values_are_recomputed_in_stage2_from_the_boundary():
    model = ShapeValues()
    split = split_and_verify(model, (batch(3, 2, 4, 4),), recompute="never")
    assert boundary_summary(split) == {"view": ((3, 48), 0, 192)}
    # stage 2 reads features.shape[0] from the cached tensor: no need to cache the images
    assert "images" not in split.boundary
    shape_nodes = [n for n in split.cut.stage2 if not facts(n).is_tensor]
    assert shape_nodes and all(n.op == "call_function" for n in shape_nodes)
    other = batch(5, 2, 4, 4, seed=7)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


class LoopOverChannels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 3))
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        latents = self.encoder(x)
        total = 0
        for channel in range(latents.shape[1]):  # a fixed size: same at every batch size
            total = total + self.head(latents[:, channel : channel + 1])
        return total.mean()


def test_python_loop_over_a_fixed_dimension_is_traced():
    model = LoopOverChannels()
    split = split_and_verify(model, (batch(3, 4),))
    assert boundary_summary(split) == {"encoder": ((3, 3), 0, 12)}
    assert split.stage2.code.count("self.head(") == 3


class BatchNotFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.ones(4, 1))

    def forward(self, x):
        per_channel = self.encoder(x).t()  # (channels, batch)
        return (per_channel * self.scale).pow(2).mean()


def test_boundary_batch_dim_need_not_be_the_first():
    model = BatchNotFirst()
    split = split_and_verify(model, (batch(3, 4),))
    # encoder and its transpose cost the same; the tie goes to fewer operations in stage 2
    assert boundary_summary(split) == {"t": ((4, 3), 1, 16)}
    boundary = split.stage1(batch(6, 4, seed=2))
    assert boundary["t"].shape == (4, 6)


class TokenEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = frozen(nn.Embedding(10, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, ids, weight=None):
        out = self.head(self.embed(ids)).squeeze(-1)
        return out.mean() if weight is None else (out * weight).mean()


def token_ids(size: int) -> torch.Tensor:
    return torch.randint(0, 10, (size, 5), generator=torch.Generator().manual_seed(0))


def test_integer_inputs_and_keyword_arguments():
    model = TokenEmbeddings()
    ids = token_ids(3)
    # With "never" a frozen module call is not rerun, though the ids are 8x smaller.
    split = split_and_verify(model, (), {"ids": ids}, recompute="never")
    assert boundary_summary(split) == {"embed": ((3, 5, 16), 0, 320)}
    assert torch.equal(split.stage2(**split.stage1(ids=ids)), model(ids=ids))
    split = split_and_verify(model, (ids,), {"weight": batch(3, 5)}, recompute="never")
    assert boundary_summary(split) == {"weight": ((3, 5), 0, 20), "embed": ((3, 5, 16), 0, 320)}
    # With "auto" stage 2 looks the embeddings up itself, from the integer ids.
    split = split_and_verify(model, (), {"ids": ids}, recompute="auto")
    assert boundary_summary(split) == {"ids": ((3, 5), 0, 40)}
    assert split.boundary["ids"].dtype == torch.int64


def test_stage1_takes_an_omitted_default_argument_under_its_own_name():
    model = TokenEmbeddings()
    ids = token_ids(3)
    split = split_and_verify(model, (ids,))
    assert torch.equal(split.stage2(**split.stage1(ids, weight=None)), model(ids, weight=None))
    assert split.input_names in (("ids",), ("ids", "weight"))


class BatchSizeFromTheRawInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(64, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, pixels):
        latents = self.encoder(pixels)
        steps = torch.randint(0, 10, (pixels.shape[0],))  # batch size read from the raw input
        return (self.head(latents).squeeze(-1) * steps).mean()


def test_stage2_reading_the_batch_size_of_an_input_does_not_cache_the_input():
    model = BatchSizeFromTheRawInput()
    split = split_and_verify(model, (batch(3, 64),))
    # pixels cost 256 B per sample; stage 2 needs only their batch size
    assert "pixels" not in split.boundary
    assert sum(spec.bytes_per_sample for spec in split.boundary.values()) == 16


# -- per-dataset constants ----------------------------------------------------------------------
class ClassEmbeddings(nn.Module):
    """Scores against class embeddings computed from frozen weights alone (no data)."""

    def __init__(self) -> None:
        super().__init__()
        self.classes = nn.Parameter(torch.randn(5, 4), requires_grad=False)
        self.register_buffer("positions", torch.randn(6, 4))
        self.projection = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        class_embeddings = self.projection(self.classes)
        position_bias = torch.tanh(self.projection(self.positions)).sum(0)
        logits = (self.head(x) + position_bias) @ class_embeddings.T
        return logits.logsumexp(1).mean()


def test_values_from_frozen_weights_alone_are_stored_once():
    model = ClassEmbeddings()
    split = split_and_verify(model, (batch(3, 4),))
    constants = {key: spec for key, spec in split.boundary.items() if spec.batch_dim is None}
    assert sorted(spec.shape for spec in constants.values()) == [(4,), (4, 5)]
    assert all(spec.bytes_per_sample == 0 and spec.is_constant for spec in constants.values())
    assert boundary_summary(split)["x"] == ((3, 4), 0, 16)
    assert set(split.boundary) == {"x", *constants}
    assert "projection" not in {name.split(".")[0] for name in param_names(split.stage2, model)}
    assert split.stage1.projection is model.projection
    assert "const" in split.report()
    x = batch(5, 4, seed=3)
    boundary = split.stage1(x)
    assert all(boundary[key].shape == constants[key].shape for key in constants)
    assert torch.equal(split.stage2(**boundary), model(x))


# -- what stage 2 may recompute -----------------------------------------------------------------
class CheapViewsOfExpensiveWork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 64), requires_grad=False)
        self.encoder = frozen(nn.Linear(64, 16))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        wide = x @ self.weight  # frozen matmul that makes the value 16x bigger
        latents = self.encoder(wide)
        grid = latents.view(-1, 4, 4)
        both = torch.stack([grid, grid.transpose(1, 2)], dim=1)  # cheap, but twice the bytes
        return self.head(both).mean()


def test_cheap_views_are_recomputed_and_expensive_matmuls_never_are():
    model = CheapViewsOfExpensiveWork()
    split = split_and_verify(model, (batch(3, 4),))
    # Storing x (16 B) would be cheapest, but the matmul and encoder must not rerun; storing
    # the stacked views (128 B) would cost twice the encoder's output. Between the encoder's
    # output and its view (64 B each) the tie goes to fewer operations in stage 2.
    assert boundary_summary(split) == {"view": ((3, 4, 4), 0, 64)}
    assert {"transpose", "stack"} <= stage2_names(split)
    assert not {"matmul", "encoder", "weight", "view"} & stage2_names(split)
    assert not [n for n in split.cut.stage2 if is_banned(n, split.cut.taint)]
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}


class ExpandingMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 64), requires_grad=False)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(x @ self.weight).mean()


def test_frozen_matmul_is_stored_with_never_even_when_its_input_is_smaller():
    model = ExpandingMatmul()
    split = split_and_verify(model, (batch(3, 4),), recompute="never")
    assert boundary_summary(split) == {"matmul": ((3, 64), 0, 256)}
    assert "matmul" not in stage2_names(split)
    # "auto" prices it (512 FLOP and 1 KiB of weight per 16x the bytes) and redoes it.
    split = split_and_verify(model, (batch(3, 4),), recompute="auto")
    assert boundary_summary(split) == {"x": ((3, 4), 0, 16)}
    assert {"matmul", "weight"} <= stage2_names(split)
    assert param_names(split.stage2, model) == {"weight", "head.weight", "head.bias"}
