"""Adversarial exactness tests of the call memo: real module patterns, each repeated at least
three times with one call signature (the memo answers from the third call on).

Every test splits the same step twice, with the memo and with it turned off
(``call_memo.replay_or_call_module`` and ``call_memo.replay_or_run_node`` always run), and
checks that the two plans are the same (node facts, op records, generated stages, boundary)
and that the memoised split reproduces eager bit for bit (``graphsplit.verify``). Where the
step cannot be split, both must refuse it alike.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphsplit
from graphsplit.planning.meta import call_memo

WIDTH = 8


# -- the oracle --------------------------------------------------------------------------------
def _plan(parts: graphsplit.Split) -> tuple:
    facts = [(n.name, n.meta.get("facts"), n.meta.get("op_record")) for n in parts.graph.nodes]
    return facts, parts.stage1.code, parts.stage2.code, parts.boundary


def _split_or_error(model: nn.Module, args: tuple) -> graphsplit.Split | tuple[type, str]:
    try:
        return graphsplit.split(model, args, path="trace")
    except graphsplit.GraphsplitError as exc:
        return type(exc), str(exc)


def _memoised_and_plain(monkeypatch, model: nn.Module, args: tuple) -> tuple[object, object, int]:
    """``(split with the memo, split without it, memo hits)``; a split that fails is
    ``(error type, message)``."""
    memos: list[call_memo.CallMemo] = []
    made = call_memo.CallMemo.__init__

    def counted(self, op_memo):
        made(self, op_memo)
        memos.append(self)

    with monkeypatch.context() as patch:
        patch.setattr(call_memo.CallMemo, "__init__", counted)
        memoised = _split_or_error(model, args)
    with monkeypatch.context() as patch:
        patch.setattr(call_memo, "replay_or_call_module", lambda memo, module, call, a, k: call())
        patch.setattr(call_memo, "replay_or_run_node", lambda memo, h, m, r, run, a: run())
        plain = _split_or_error(model, args)
    return memoised, plain, sum(memo.hits for memo in memos)


def _check(monkeypatch, model: nn.Module, *args: torch.Tensor) -> int:
    """Assert the memo changes nothing for ``model(*args)``; return its hits."""
    memoised, plain, hits = _memoised_and_plain(monkeypatch, model, args)
    if isinstance(plain, tuple) or isinstance(memoised, tuple):
        assert memoised == plain
        return hits
    assert _plan(memoised) == _plan(plain)
    comparisons = graphsplit.verify(model, memoised, args, seed=0)
    assert comparisons and all(comparison.ok for comparison in comparisons)
    return hits


def _batch(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Step(nn.Module):
    """Frozen ``blocks`` called in turn (each one's signature repeats), then a trainable head."""

    def __init__(self, blocks: list[nn.Module], *, freeze: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        if freeze:
            self.blocks.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def _xy(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch(batch, WIDTH), _batch(batch, 1, seed=1)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_the_oracle_sees_memo_hits(monkeypatch):
    """The baseline: plain repeated blocks are answered by the memo and the plan is unchanged."""
    hits = _check(monkeypatch, Step([Plain() for _ in range(4)]), *_xy())
    assert hits > 0


# -- Python state read in forward --------------------------------------------------------------
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.scale = 1.0
        self.noisy = False

    def forward(self, x):
        h = self.linear(x) * self.scale
        return F.dropout(h, 0.5, training=True) if self.noisy else h


class TogglesItsChild(nn.Module):
    """A block calling one child four times with its attributes changed in between: the third
    call turns random (dropout) and the fourth mixes samples."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        for step in range(4):
            self.inner.noisy = step == 2
            self.inner.scale = 1.0
            x = self.inner(x)
            if step == 3:
                x = x - x.mean(0)
        self.inner.noisy = False
        return x


def test_a_child_whose_flags_change_between_calls(monkeypatch):
    _check(monkeypatch, Step([TogglesItsChild() for _ in range(3)]), *_xy())


class CountsItsCalls(nn.Module):
    """Every third call draws noise: a counter kept as a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.linear(x)
        return h + torch.randn_like(h) if self.calls % 3 == 0 else h


class CallsCounterChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = CountsItsCalls()

    def forward(self, x):
        self.counter.calls = 0  # every step starts counting anew (eager and stages alike)
        for _ in range(4):
            x = self.counter(x)
        return x


def test_a_call_counter_that_turns_random_on_the_third_call(monkeypatch):
    _check(monkeypatch, Step([CallsCounterChild()]), *_xy())


class CountsInAHelper:
    """A helper object holding state (an attention processor with a step counter)."""

    def __init__(self) -> None:
        self.step = 0


class UsesAProcessor(nn.Module):
    def __init__(self, processor: CountsInAHelper) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.processor = processor

    def forward(self, x):
        self.processor.step += 1
        h = self.linear(x)
        return h - h.mean(0) if self.processor.step >= 3 else h


def test_a_shared_processor_object_counting_calls(monkeypatch):
    shared = CountsInAHelper()

    class Calls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = UsesAProcessor(shared)

        def forward(self, x):
            shared.step = 0
            for _ in range(4):
                x = self.layer(x)
            return x

    _check(monkeypatch, Step([Calls()]), *_xy())


class RotaryCache(nn.Module):
    """transformers' old rotary embedding: cos/sin cached as tensor attributes, rebuilt when
    the sequence grows."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.cached_len = 0
        self.cos = None

    def forward(self, x):
        length = x.shape[-1]
        if length > self.cached_len:
            self.cached_len = length
            self.cos = torch.arange(length, dtype=x.dtype, device=x.device).cos()
        return self.linear(x) * self.cos[:length]


class CallsRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = RotaryCache()

    def forward(self, x):
        for _ in range(4):
            x = self.rotary(x)
        return x


def test_a_rotary_cache_held_as_tensor_attributes(monkeypatch):
    _check(monkeypatch, Step([CallsRotary()]), *_xy())


class DictCache(nn.Module):
    """A dict cache of shapes seen (diffusers' processors keep such state)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seen: dict[tuple, int] = {}

    def forward(self, x):
        count = self.seen.get(tuple(x.shape), 0) + 1
        self.seen[tuple(x.shape)] = count
        h = self.linear(x)
        return h * 2 if count == 3 else h


class CallsDictCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cache = DictCache()

    def forward(self, x):
        self.cache.seen.clear()
        for _ in range(4):
            x = self.cache(x)
        return x


def test_a_dict_cache_counting_shapes(monkeypatch):
    _check(monkeypatch, Step([CallsDictCache()]), *_xy())


class TrainingMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(self.linear(x))


def test_blocks_in_train_and_eval_mode(monkeypatch):
    blocks = [TrainingMode() for _ in range(4)]
    blocks[0].eval(), blocks[1].eval(), blocks[3].eval()  # only the third one draws
    step = Step(blocks)
    step.blocks.requires_grad_(False)
    _check(monkeypatch, step, *_xy())


# -- results that alias ------------------------------------------------------------------------
class ReturnsTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.linear(x)
        return h, h


class ReturnsAViewOfAnOutput(ReturnsTwice):
    def forward(self, x):
        h = self.linear(x)
        return h, h.t()


class ReturnsItsInput(ReturnsTwice):
    def forward(self, x):
        return self.linear(x), x


class ReturnsAViewOfItsWeight(ReturnsTwice):
    def forward(self, x):
        return self.linear(x), self.linear.weight.t()


class WritesTheFirstOutput(nn.Module):
    """The step writes into one result in place and reads another later: aliasing decides."""

    def __init__(self, block_class: type) -> None:
        super().__init__()
        self.block = block_class().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        outs = [self.block(x) for _ in range(4)]
        a, b = outs[3]
        a.mul_(2)
        return F.mse_loss(self.head(b if b.shape == a.shape else a), y)


@pytest.mark.parametrize(
    "block_class", [ReturnsTwice, ReturnsAViewOfAnOutput, ReturnsItsInput, ReturnsAViewOfItsWeight]
)
def test_results_that_alias_each_other_an_input_or_a_weight(monkeypatch, block_class):
    x, y = _xy()
    _check(monkeypatch, WritesTheFirstOutput(block_class), x[:, :WIDTH].contiguous(), y)


_TABLE = torch.arange(4 * WIDTH, dtype=torch.float32).reshape(4, WIDTH)  # a module-level constant


class ReturnsAGlobalTable(nn.Module):
    """Returns a module-level constant tensor (a precomputed table) as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.linear(x), _TABLE


class WritesAGlobalTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ReturnsAGlobalTable().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        results = [self.block(x) for _ in range(3)]
        h = results[0][0] + results[0][1] + results[2][1]
        return F.mse_loss(self.head(h), y)


def test_a_result_that_is_a_global_constant(monkeypatch):
    _check(monkeypatch, WritesAGlobalTable(), *_xy())


# -- in-place writes ---------------------------------------------------------------------------
class ReluInPlaceChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.linear(x))


class WritesItsInputInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        self.act(x)  # relu_ on the block's input
        return self.linear(x)


class SetsItemOfItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x[:, 0] = 0
        return self.linear(x)


class CallsThrice(nn.Module):
    """Calls one child thrice on the same input (a write into it is seen by the next call)."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x):
        x = x * 1  # the step's input is not written
        outs = [self.child(x) for _ in range(4)]
        return sum(outs) + x


@pytest.mark.parametrize("child", [ReluInPlaceChild, WritesItsInputInPlace, SetsItemOfItsInput])
def test_in_place_writes_in_a_repeated_child(monkeypatch, child):
    _check(monkeypatch, Step([CallsThrice(child())]), *_xy())


class StepWritesInTheGraph(nn.Module):
    """In-place writes in the step's own code: repeated ``setitem``/``add_`` nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        hs = [self.frozen(x) for _ in range(4)]
        for h in hs:
            h[:, 0] = 0
            h.add_(1)
        return F.mse_loss(self.head(sum(hs)), y)


def test_in_place_writes_on_repeated_nodes(monkeypatch):
    _check(monkeypatch, StepWritesInTheGraph(), *_xy())


# -- random draws and sample mixing ------------------------------------------------------------
class Noise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.linear(x) + torch.randn_like(x)


class BatchNormBlock(nn.Module):
    def __init__(self, track: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH, track_running_stats=track)

    def forward(self, x):
        return self.norm(self.linear(x))


class MeanOverBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.linear(x)
        return h - h.mean(dim=0, keepdim=True)


@pytest.mark.parametrize(
    "make",
    [
        TrainingMode,
        Noise,
        lambda: BatchNormBlock(track=True),
        lambda: BatchNormBlock(track=False),
        MeanOverBatch,
    ],
    ids=["dropout", "randn_like", "batchnorm", "batchnorm_untracked", "mean_over_batch"],
)
def test_random_and_mixing_blocks_stay_random_and_mixing(monkeypatch, make):
    step = Step([make() for _ in range(4)])
    step.train()
    _check(monkeypatch, step, *_xy())


# -- trainable parameters ----------------------------------------------------------------------
class LoraBlock(nn.Module):
    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, 2, bias=False)
        self.up = nn.Linear(2, WIDTH, bias=False)
        self.enabled = enabled

    def forward(self, x):
        h = self.base(x)
        return h + self.up(self.down(x)) if self.enabled else h


def test_a_lora_read_only_in_the_third_block(monkeypatch):
    blocks = [LoraBlock(enabled=index == 2) for index in range(4)]
    step = Step(blocks, freeze=False)
    for block in blocks:
        block.base.requires_grad_(False)
    _check(monkeypatch, step, *_xy())


def test_a_lora_trainable_only_in_the_third_block(monkeypatch):
    blocks = [LoraBlock(enabled=True) for _ in range(4)]
    step = Step(blocks)
    blocks[2].up.requires_grad_(True)
    blocks[2].down.requires_grad_(True)
    _check(monkeypatch, step, *_xy())


class SharedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_blocks_sharing_a_parameter_some_trainable(monkeypatch):
    shared = nn.Linear(WIDTH, WIDTH)
    frozen = [Plain().requires_grad_(False) for _ in range(3)]
    step = Step([*frozen, SharedLinear(shared), SharedLinear(shared), SharedLinear(shared)])
    step.blocks.requires_grad_(False)
    shared.requires_grad_(True)
    _check(monkeypatch, step, *_xy())


# -- hooks -------------------------------------------------------------------------------------
def test_a_forward_hook_on_the_third_blocks_child(monkeypatch):
    blocks = [Plain() for _ in range(4)]
    blocks[2].linear.register_forward_hook(lambda module, args, out: out * 2)
    _check(monkeypatch, Step(blocks), *_xy())


def test_a_forward_pre_hook_on_the_third_block(monkeypatch):
    blocks = [CallsThrice(Plain()) for _ in range(2)]
    blocks[1].child.register_forward_pre_hook(lambda module, args: (args[0] - args[0].mean(0),))
    _check(monkeypatch, Step(blocks), *_xy())


def test_a_hook_removed_after_the_second_call(monkeypatch):
    class RemovesItsHook(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Plain()

        def forward(self, x):
            handle = self.child.register_forward_hook(lambda m, a, out: out - out.mean(0))
            outs = [self.child(x)]
            handle.remove()
            outs += [self.child(x) for _ in range(3)]
            return sum(outs)

    _check(monkeypatch, Step([RemovesItsHook()]), *_xy())


# -- global switches around one call -----------------------------------------------------------
class GradAndAutocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Plain()

    def forward(self, x):
        outs = [self.child(x) for _ in range(3)]
        with torch.no_grad():
            outs.append(self.child(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(self.child(x).float())
        outs += [self.child(x) for _ in range(2)]
        return sum(outs)


def test_no_grad_and_autocast_around_one_call(monkeypatch):
    _check(monkeypatch, Step([GradAndAutocast()]), *_xy())


class AutocastInTheStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Plain().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [self.block(x).float() for _ in range(3)]
        return F.mse_loss(self.head(sum(outs)), y)


def test_autocast_in_the_step_around_repeated_leaf_calls_is_refused_alike(monkeypatch):
    # The step's own autocast is refused (planning/rules/grad_modes.py), with the memo as without
    # it.
    memoised, plain, hits = _memoised_and_plain(monkeypatch, AutocastInTheStep(), _xy())
    assert hits > 0
    assert isinstance(memoised, tuple) and memoised == plain
    assert "switches autocast inside its traced code" in memoised[1]


def test_no_grad_around_repeated_leaf_calls(monkeypatch):
    class Step2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Plain().requires_grad_(False)
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):
            outs = [self.block(x) for _ in range(3)]
            with torch.no_grad():
                outs += [self.block(x) for _ in range(3)]
            return F.mse_loss(self.head(sum(outs)), y)

    _check(monkeypatch, Step2(), *_xy())


class CastsToItsWeight(Plain):
    def forward(self, x):
        return torch.tanh(self.linear(x.to(self.linear.weight.dtype))).to(x.dtype)


class InputsOfManyLayouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = CastsToItsWeight()

    def forward(self, x):
        square = x[:, :WIDTH]
        outs = [self.child(square) for _ in range(3)]
        outs += [self.child(square.t().contiguous().t()) for _ in range(3)]  # other strides
        outs += [self.child(square.double()).float() for _ in range(3)]  # other dtype
        outs += [self.child(square[::1]) for _ in range(3)]
        return sum(outs)


def test_inputs_of_other_strides_and_dtypes(monkeypatch):
    x, y = _xy()
    step = Step([InputsOfManyLayouts()])
    _check(monkeypatch, step, x, y)


def test_inputs_that_need_grad_or_not(monkeypatch):
    class Step3(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Plain().requires_grad_(False)
            self.lora = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):
            trained = self.lora(x)  # needs grad
            outs = [self.block(x) for _ in range(3)] + [self.block(trained) for _ in range(3)]
            return F.mse_loss(self.head(sum(outs)), y)

    _check(monkeypatch, Step3(), *_xy())


# -- results that are no tensors ---------------------------------------------------------------
@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    width: int


class ReturnsStructures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.linear(x)
        return BlockOutput(h, h.shape[-1]), (h.shape[0], h * 2), {"h": h + 1}


class ReadsStructures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = ReturnsStructures()

    def forward(self, x):
        total = x
        for _ in range(4):
            out, (rows, doubled), named = self.child(x)
            total = total + out.hidden * out.width + doubled * rows + named["h"]
        return total


def test_dataclass_tuple_and_int_results(monkeypatch):
    _check(monkeypatch, Step([ReadsStructures()]), *_xy())


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_a_model_output_result(monkeypatch):
    from transformers.modeling_outputs import BaseModelOutput

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            h = self.linear(x)
            return BaseModelOutput(last_hidden_state=h, hidden_states=(x, h))

    class CallsEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()

        def forward(self, x):
            outs = [self.encoder(x) for _ in range(4)]
            return sum(out.last_hidden_state + out.hidden_states[0] for out in outs)

    _check(monkeypatch, Step([CallsEncoder()]), *_xy())


# -- gradient checkpointing --------------------------------------------------------------------
class CheckpointedStep(nn.Module):
    def __init__(self, trainable_block: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Plain() for _ in range(4)]).requires_grad_(False)
        if trainable_block:
            self.blocks[2].requires_grad_(True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return F.mse_loss(self.head(x), y)


@pytest.mark.parametrize("trainable_block", [False, True])
def test_gradient_checkpointing_around_repeated_blocks(monkeypatch, trainable_block):
    _check(monkeypatch, CheckpointedStep(trainable_block), *_xy())


# -- peft --------------------------------------------------------------------------------------
def _peft_step(**lora: object) -> nn.Module:
    import peft

    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(4)])
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return F.mse_loss(self.head(x), y)

    config = peft.LoraConfig(r=2, target_modules=["layers.0", "layers.1", "layers.2", "layers.3"])
    model = peft.get_peft_model(Tower(), config, **lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, generator=torch.Generator().manual_seed(len(name)))
    for param in model.base_model.model.head.parameters():
        param.requires_grad_(True)
    return model


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed")
@pytest.mark.parametrize("variant", ["plain", "scaling", "disabled", "two_adapters"])
def test_peft_lora_layers_with_state_changed_in_one_layer(monkeypatch, variant):
    model = _peft_step()
    layers = model.base_model.model.layers
    if variant == "scaling":
        layers[2].scaling["default"] = 7.0
    elif variant == "disabled":
        layers[2].enable_adapters(False)
    elif variant == "two_adapters":
        import peft

        model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["layers.2"]))
        layers[2].set_adapter("other")
        for name, param in layers[2].named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, generator=torch.Generator().manual_seed(3))
    step = model.base_model.model
    _check(monkeypatch, step, *_xy())


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed")
def test_peft_disable_adapter_around_the_third_call(monkeypatch):
    model = _peft_step()

    class Calls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.peft = model

        def forward(self, x, y):
            losses = [self.peft(x, y) for _ in range(2)]
            with self.peft.disable_adapter():
                losses.append(self.peft(x, y))
            return sum(losses)

    _check(monkeypatch, Calls(), *_xy())


# -- found by review: what the call signature must also see ---------------------------------------
# Each test below failed before the signature held it (argument identity, attributes named like
# hooks, closure cells, sets as multisets): the memo answered a call from an entry learnt under
# other circumstances. The global flag is still a documented assumption (strict xfail).
class SelfOrCrossAttention(nn.Module):
    """``context is x`` picks the path (``F.multi_head_attention_forward`` does the same with
    ``query is key`` / ``key is value``); the cross path mixes the samples of ``context``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, context):
        h = self.linear(x)
        return h if context is x else h + self.linear(context).mean(0)


class SelfThenCross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = SelfOrCrossAttention().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        x, context = x * 1, x * 1  # two tensors of one metadata
        h = self.attention(x, x) + self.attention(x, x) + self.attention(x, context)
        return F.mse_loss(self.head(h), y)


def test_which_arguments_are_the_same_tensor_is_part_of_the_signature(monkeypatch):
    model = SelfThenCross()
    x, y = _xy()
    memoised, plain, _hits = _memoised_and_plain(monkeypatch, model, (x, y))
    assert _plan(memoised) == _plan(plain)


def test_a_cache_cut_to_two_samples_gives_eager_loss_on_them():
    model = SelfThenCross()
    x, y = _xy()
    parts = graphsplit.split(model, (x, y))
    cached = parts.stage1(x, y)
    batched = {key for key, spec in parts.boundary.items() if spec.batch_dim == 0}
    two = {key: value[:2] if key in batched else value for key, value in cached.items()}
    assert torch.equal(parts.stage2(**two), model(x[:2], y[:2]))


class PackedOrSeparateAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        x = x.view(x.shape[0], 2, WIDTH // 2).repeat(1, 1, 2)
        memory = x * 1
        outs = [self.attention(x, x, x, need_weights=False)[0] for _ in range(2)]
        outs.append(self.attention(x, memory, memory, need_weights=False)[0])
        return F.mse_loss(self.head(sum(outs).sum(1)), y)


def test_multihead_attention_self_and_cross_calls_keep_their_records(monkeypatch):
    memoised, plain, _hits = _memoised_and_plain(monkeypatch, PackedOrSeparateAttention(), _xy())
    assert _plan(memoised) == _plan(plain)


class MixesUnlessSkipped(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.skip_hooks = True  # a flag of the user's: its name contains "hooks"

    def forward(self, x):
        h = self.linear(x)
        return h if self.skip_hooks else h - h.mean(0)


class TogglesAFlagNamedHooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = MixesUnlessSkipped()

    def forward(self, x):
        outs = []
        for index in range(3):
            self.child.skip_hooks = index < 2
            outs.append(self.child(x))
        self.child.skip_hooks = True
        return sum(outs)


def test_an_attribute_named_like_hooks_is_part_of_the_signature(monkeypatch):
    memoised, plain, _hits = _memoised_and_plain(
        monkeypatch, Step([TogglesAFlagNamedHooks()]), _xy()
    )
    assert _plan(memoised) == _plan(plain)


def _mixing_gate(state: dict) -> object:
    return lambda h: h - h.mean(0) if state["mix"] else h


class GatedByAClosure(Plain):
    def __init__(self, state: dict) -> None:
        super().__init__()
        self.gate = _mixing_gate(state)  # a function attribute: keyed by identity only

    def forward(self, x):
        return self.gate(self.linear(x))


class SetsTheClosuresState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.state = {"mix": False}
        self.child = GatedByAClosure(self.state)

    def forward(self, x):
        outs = []
        for index in range(3):
            self.state["mix"] = index == 2
            outs.append(self.child(x))
        self.state["mix"] = False
        return sum(outs)


def test_a_closure_whose_cell_changes_between_calls(monkeypatch):
    memoised, plain, _hits = _memoised_and_plain(monkeypatch, Step([SetsTheClosuresState()]), _xy())
    assert _plan(memoised) == _plan(plain)


_MIX = [False]


class ReadsAGlobalFlag(Plain):
    def forward(self, x):
        h = self.linear(x)
        return h - h.mean(0) if _MIX[0] else h


class SetsTheGlobalFlag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = ReadsAGlobalFlag()

    def forward(self, x):
        outs = []
        for index in range(3):
            _MIX[0] = index == 2
            outs.append(self.child(x))
        _MIX[0] = False
        return sum(outs)


@pytest.mark.xfail(
    strict=True,
    reason="documented assumption (Python globals are fixed during one analysis), shown "
    "failing: a global flag set between calls inside one leaf's forward is not seen",
)
def test_a_global_flag_set_between_calls(monkeypatch):
    memoised, plain, _hits = _memoised_and_plain(monkeypatch, Step([SetsTheGlobalFlag()]), _xy())
    assert _plan(memoised) == _plan(plain)


class Processor:
    def __init__(self) -> None:
        self.order = 1


class RunsItsProcessors(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.processors: set[Processor] = set()

    def forward(self, x):
        h = self.linear(x)
        for _ in self.processors:
            h = h - h.mean(0)
        return h


class AddsAProcessor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = RunsItsProcessors()
        self.first, self.second = Processor(), Processor()

    def forward(self, x):
        self.child.processors = {self.first}
        outs = [self.child(x), self.child(x)]
        self.child.processors = {self.first, self.second}
        outs.append(self.child(x))
        self.child.processors = set()
        return sum(outs)


def test_a_set_of_equal_helpers_is_not_a_set_of_one(monkeypatch):
    memoised, plain, _hits = _memoised_and_plain(monkeypatch, Step([AddsAProcessor()]), _xy())
    assert _plan(memoised) == _plan(plain)


# -- more patterns -------------------------------------------------------------------------------
class EmaBuffer(Plain):
    """Updates a running average by rebinding its buffer's ``.data`` (no ATen write)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("average", torch.zeros(WIDTH))

    def forward(self, x):
        h = self.linear(x)
        if self.training:
            self.average.data = 0.9 * self.average + 0.1 * h.mean(0).detach()
        return h + self.average


def test_a_buffer_rebound_through_data_in_train_mode(monkeypatch):
    step = Step([EmaBuffer() for _ in range(4)])
    step.train()
    _check(monkeypatch, step, *_xy())


class LlamaStep(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        import transformers

        from tests.helpers import tiny_llama_config

        dropout = 0.5 if variant == "attention_dropout" else 0.0
        config = tiny_llama_config(num_hidden_layers=4, attention_dropout=dropout)
        config._attn_implementation = "eager"
        self.model = transformers.LlamaModel(config).requires_grad_(False)
        if variant == "checkpointing":
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        lora = variant == "lora"
        if lora:
            import peft

            targets = ["q_proj", "v_proj"]
            self.model = peft.get_peft_model(
                self.model, peft.LoraConfig(r=2, target_modules=targets)
            )
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    nn.init.normal_(param, generator=torch.Generator().manual_seed(len(name)))
        self.head = nn.Linear(config.hidden_size, 1)

    def forward(self, ids, y):
        hidden = self.model(input_ids=ids).last_hidden_state
        return F.mse_loss(self.head(hidden[:, -1]), y)


@pytest.mark.slow  # the first one pays transformers' import (about 2.5 s)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
@pytest.mark.parametrize("variant", ["plain", "lora", "checkpointing", "attention_dropout"])
def test_a_tiny_llama_in_train_mode(monkeypatch, variant):
    if variant == "lora" and importlib.util.find_spec("peft") is None:
        pytest.skip("peft not installed")
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    model = LlamaStep(variant)
    model.train()
    assert _check(monkeypatch, model, ids, _batch(4, 1)) > 0


class DiffusersAttentions(nn.Module):
    """diffusers' ``Attention`` blocks, the third with another processor (a helper object
    keyed by its class and attributes) and a scale of its own."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers.models.attention_processor import Attention, AttnProcessor

        self.blocks = nn.ModuleList(
            [Attention(WIDTH, heads=2, dim_head=4) for _ in range(4)]
        ).requires_grad_(False)
        self.blocks[2].set_processor(AttnProcessor())
        self.blocks[3].scale = 0.25
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = x.view(x.shape[0], 2, WIDTH // 2).repeat(1, 1, 2)
        for block in self.blocks:
            h = block(h) + h
        return F.mse_loss(self.head(h.sum(1)), y)


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="no diffusers")
def test_diffusers_attention_with_another_processor_in_one_block(monkeypatch):
    assert _check(monkeypatch, DiffusersAttentions(), *_xy()) > 0
