"""The module-call memo: a replayed call gives what a run gives; impure calls always run."""

from __future__ import annotations

import importlib.util
import operator
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import graphsplit
from graphsplit.planning.meta import analysis_view as meta
from graphsplit.planning.meta import call_memo, call_signature
from graphsplit.planning.meta.analysis_view import analysis_view, meta_execution, module_called
from graphsplit.planning.meta.meta_interpreter import fetch
from graphsplit.planning.meta.op_recorder import recorded
from graphsplit.planning.meta.tracing_interpreter import TracingInterpreter


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.linear(x))) * self.scale + x


class RepeatedBlocks(nn.Module):
    """Frozen repeated blocks, then a trainable head: every block call after the second is
    answered by the memo while the tracer computes the encoder's value."""

    def __init__(self, blocks: int = 6) -> None:
        super().__init__()
        self.encoder = nn.Sequential(*[Block() for _ in range(blocks)]).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.encoder(x)), y)


def _memo() -> call_memo.CallMemo:
    memo = meta.current_call_memo()
    assert memo is not None
    return memo


def _call(module: nn.Module, *args: object) -> object:
    return module_called(module, lambda: module(*args), args, {})


def _calls(module: nn.Module, x: torch.Tensor, times: int = 3) -> list[object]:
    return [_call(module, x) for _ in range(times)]


def _metadata(tensor: torch.Tensor) -> tuple:
    return (type(tensor), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _facts_and_code(parts: graphsplit.Split) -> tuple:
    facts = [(n.name, n.meta.get("facts"), n.meta.get("op_record")) for n in parts.graph.nodes]
    return facts, parts.stage1.code, parts.stage2.code, parts.boundary


def test_a_replayed_call_gives_the_metadata_and_op_record_of_a_run():
    block = Block().requires_grad_(False)
    x = torch.empty(4, 3, 8, device="meta")
    with analysis_view(block), meta_execution():
        runs = [recorded(lambda: _call(block, x)) for _ in range(4)]
        memo = _memo()
        assert (memo.misses, memo.hits) == (1, 2)  # first unwatched, then watched, then hits
    (first, first_record), *others = runs
    for value, record in others:
        assert type(value) is FakeTensor and value is not first
        assert _metadata(value) == _metadata(first)
        assert record == first_record
    assert first_record.flops > 0 and first_record.ops


def test_a_replayed_call_without_recorder_adds_no_ops_and_a_recorded_one_adds_them():
    block = Block().requires_grad_(False)
    x = torch.empty(2, 8, device="meta")
    with analysis_view(block), meta_execution():
        _calls(block, x, times=2)  # learnt without a recorder
        _, record = recorded(lambda: _call(block, x))  # a new signature: recorder on
        _, again = recorded(lambda: _call(block, x))
        _, last = recorded(lambda: _call(block, x))
    assert record == again == last and record.ops


def _without_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_memo, "replay_or_call_module", lambda memo, module, call, a, k: call())
    monkeypatch.setattr(
        call_memo, "replay_or_run_node", lambda memo, head, module, record, run, _: run()
    )


def _hits_while(function) -> int:
    memos: list[call_memo.CallMemo] = []
    created = call_memo.CallMemo.__init__

    def noted(self, op_memo):
        created(self, op_memo)
        memos.append(self)

    call_memo.CallMemo.__init__ = noted
    try:
        function()
    finally:
        call_memo.CallMemo.__init__ = created
    return sum(memo.hits for memo in memos)


def test_split_plans_are_the_same_with_and_without_the_memo(monkeypatch):
    model = RepeatedBlocks()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    memoised: list[graphsplit.Split] = []
    assert _hits_while(lambda: memoised.append(graphsplit.split(model, (x, y)))) > 0
    _without_memo(monkeypatch)
    plain = graphsplit.split(model, (x, y))
    assert _facts_and_code(memoised[0]) == _facts_and_code(plain)
    batch = memoised[0].stage1(x, y)
    assert torch.equal(memoised[0].stage2(**batch), model(x, y))


def test_a_peft_lora_sd_step_plans_the_same_with_and_without_the_memo(monkeypatch):
    """peft's LoRA layers (their ``kwargs`` left out of the key), diffusers' blocks."""
    pytest.importorskip("peft")
    from tests.zoo import SD_SIZES, build_sd_lora_step

    size = SD_SIZES["tiny"]
    step = build_sd_lora_step(size="tiny", frozen_on_meta=True, trainable_on_meta=True)
    with torch.device("meta"):
        batch = (
            torch.empty(2, 3, size.resolution, size.resolution),
            torch.zeros(2, size.max_tokens, dtype=torch.long),
        )
    memoised: list[graphsplit.Split] = []
    assert _hits_while(lambda: memoised.append(graphsplit.split(step, batch))) > 0
    _without_memo(monkeypatch)
    assert _facts_and_code(memoised[0]) == _facts_and_code(graphsplit.split(step, batch))


def test_different_state_or_arguments_are_different_signatures():
    wide, narrow = Block(), Block()
    narrow.scale = 2  # an int where the other holds a float: another key
    x = torch.empty(2, 8, device="meta")
    with analysis_view(nn.ModuleList([wide, narrow])), meta_execution():
        _calls(wide, x)  # unwatched, learnt, answered
        _call(narrow, x)  # its arguments were seen: learnt under its own signature
        _call(wide, torch.empty(3, 8, device="meta"))  # another shape: first seen
        _call(wide, x.t().contiguous().t())  # other strides: first seen
        memo = _memo()
        assert (memo.misses, memo.hits, len(memo.entries)) == (2, 1, 2)


class WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x.add_(1)
        return self.linear(x)


class WritesAViewOfItsInput(WritesInput):
    def forward(self, x):
        x[0].add_(1)
        return self.linear(x)


class WritesItsBuffer(WritesInput):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.linear(x)


class WritesItsIntermediate(WritesInput):
    """``F.rms_norm``'s decomposition does this (``add_``, ``rsqrt_`` on its variance)."""

    def forward(self, x):
        h = self.linear(x) * 2
        h.add_(1).rsqrt_()
        return h * x


class DrawsNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) + torch.randn_like(x)


class ReturnsAView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        self.linear(x)
        return x[:, :4]


class ReturnsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear.weight


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


class HoldsATensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.offset = torch.zeros(8, device="meta")  # neither parameter nor buffer

    def forward(self, x):
        return self.offset  # a fresh copy would not be this tensor


@pytest.mark.parametrize(
    "module_class",
    [
        WritesInput,
        WritesAViewOfItsInput,
        WritesItsBuffer,
        DrawsNoise,
        ReturnsAView,
        ReturnsItsWeight,
        CountsCalls,
    ],
)
def test_impure_calls_are_refused_and_always_run(module_class):
    module = module_class()
    x = torch.empty(2, 8, device="meta")
    with analysis_view(module), meta_execution():
        values = [_call(module, x) for _ in range(4)]
        memo = _memo()
        assert memo.hits == 0 and memo.misses >= 1  # a new count is a new signature
        assert set(memo.entries.values()) == {None}
    if module_class in (WritesInput, WritesAViewOfItsInput):
        assert x._version == 4
    if module_class is CountsCalls:
        assert module.calls == 0  # the analysis view restores the module's attributes
    if module_class is ReturnsAView:
        assert all(value._is_view() for value in values)
        assert len({id(value) for value in values}) == 4


def test_a_call_writing_only_its_own_intermediates_is_memoised():
    module = WritesItsIntermediate()
    x = torch.empty(2, 8, device="meta")
    with analysis_view(module), meta_execution():
        values = _calls(module, x, times=4)
        assert (_memo().misses, _memo().hits) == (1, 2)
    assert {_metadata(value) for value in values} == {_metadata(values[0])}
    assert x._version == 0 and all(value._version == 0 for value in values[2:])


def test_calls_with_no_exact_key_always_run():
    x = torch.empty(2, 8, device="meta")
    hooked, holder = Block(), HoldsATensor()
    hooked.linear.register_forward_hook(lambda module, args, out: None)
    with analysis_view(nn.ModuleList([hooked, holder])), meta_execution():
        for module in (hooked, hooked.linear, holder):
            values = _calls(module, x, times=4)
        memo = _memo()
        assert memo.hits == memo.misses == 0
    assert all(value is holder.offset for value in values)


def test_a_global_module_hook_turns_the_memo_off():
    block = Block()
    x = torch.empty(2, 8, device="meta")
    seen: list[nn.Module] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(module)
    )
    try:
        with analysis_view(block), meta_execution():
            _calls(block, x, times=4)
            assert _memo().hits == _memo().misses == 0
    finally:
        handle.remove()
    assert seen.count(block) == 4


def test_real_runs_and_other_modes_are_not_memoised():
    block = Block()
    x = torch.randn(2, 8)
    with analysis_view(nn.Module()):
        values = _calls(block, x, times=4)  # real tensors, outside the meta execution
        assert _memo().hits == _memo().misses == 0
    assert all(torch.equal(value, block(x)) for value in values)


def test_a_result_container_is_rebuilt_fresh():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return {"h": [self.linear(x), 3], "n": None}

    pair = Pair()
    x = torch.empty(2, 8, device="meta")
    with analysis_view(pair), meta_execution():
        first, second, third = _calls(pair, x)
        assert _memo().hits == 1
    assert third["h"][1] == 3 and third["n"] is None
    assert third["h"] is not second["h"] and third["h"][0] is not second["h"][0]
    assert _metadata(third["h"][0]) == _metadata(first["h"][0])


_ASSIGNED = re.compile(r"self\.kwargs(: [^=]+)? = ")


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed")
def test_peft_reads_no_lora_layer_kwargs():
    """call_memo leaves ``LoraLayer.kwargs`` out of the key: peft must never read it."""
    import peft

    root = Path(peft.__file__).parent
    reads = [
        f"{path.relative_to(root)}: {line.strip()}"
        for path in root.rglob("*.py")
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.search(r"[\w)\]]\.kwargs\b", line) and not _ASSIGNED.search(line)
    ]
    assert reads == []
    assert ("peft.tuners.lora.layer", "LoraLayer") in call_signature._UNREAD


# -- whole nodes ------------------------------------------------------------------------------
def _node_runs(head: object, function, arguments: tuple, times: int = 3) -> list[tuple]:
    """``times`` memoised runs of ``function(*args, **kwargs)`` as one recorded node."""
    args, kwargs = arguments

    def run():
        with meta_execution():
            return recorded(lambda: function(*args, **kwargs))

    memo = meta.current_call_memo()
    return [
        call_memo.replay_or_run_node(memo, head, None, True, run, arguments) for _ in range(times)
    ]


def test_a_replayed_node_gives_the_value_metadata_and_record_of_a_run():
    x = torch.empty(4, 8, device="meta")
    with analysis_view(nn.Module()):
        runs = _node_runs(("call_function", torch.tanh), torch.tanh, ((x,), {}), times=4)
        memo = _memo()
        assert (memo.misses, memo.hits) == (1, 2)
    (first, record), *others = runs
    assert record.ops and record.ops[0].name == "tanh"
    for value, again in others:
        assert _metadata(value) == _metadata(first) and value is not first
        assert again == record


@pytest.mark.parametrize(
    "function",
    [
        torch.randn_like,  # a random draw
        lambda x: x.add_(1),  # a write into its input
        lambda x: (x, x + 1)[0],  # returns its input
        lambda x: x.view(-1),  # a view of its input
    ],
)
def test_impure_nodes_are_refused_and_always_run(function):
    x = torch.empty(4, 8, device="meta")
    with analysis_view(nn.Module()):
        values = [
            value for value, _ in _node_runs(("call_function", function), function, ((x,), {}))
        ]
        memo = _memo()
        assert memo.hits == 0 and set(memo.nodes.values()) == {None}
    assert len({id(value) for value in values}) == len(values) or values[0] is values[1]


def test_only_torch_and_operator_functions_tensor_methods_and_modules_are_memoised():
    def user_function(x):
        return x + 1

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [
        graph.call_function(torch.tanh, (x,)),
        graph.call_function(F.gelu, (x,)),
        graph.call_function(operator.add, (x, x)),
        graph.call_method("softmax", (x, -1)),
        graph.call_function(user_function, (x,)),
        graph.call_function(fetch, (x,)),
    ]
    interpreter = TracingInterpreter(nn.Module(), graph, {})
    heads = [interpreter._memo_head(node)[0] is not None for node in nodes]
    assert heads == [True, True, True, True, False, False]
