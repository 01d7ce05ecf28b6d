"""Property tests of the partition on randomly generated steps (hypothesis).

Each example is a small DAG drawn as a spec: node 0 is the batch ``x`` (batch 3, width 4), every
other node applies one op from a menu to one or two earlier nodes, and the step returns a loss
over a subset of the sinks (the other sinks are dead code, as in real steps that compute values
they do not use). The frozen set is random too, and given to ``split`` in one of its four forms.

Properties:
    1. ``graphsplit.verify`` is exact (outputs and gradients bit for bit).
    2. Stage ownership: stage 1 holds no trainable parameter and runs no tainted node; stage 2
       runs no banned node, and every tainted node the output needs and every random draw
       (dead or not: skipping one would shift the RNG stream of later draws).
       With ``recompute="auto"`` stage 2 may also run frozen work, but only the candidates
       (one layer whose inputs are already on the boundary), never random or tainted-input work
       outside stage 2's own needs.
    3. Optimality: the plan's cost equals a brute-force optimum over all sets of storable nodes
       and fixed numbers (sizes, baked into stage 2 at no bytes) that form a valid boundary.
       With ``recompute="never"`` the cost is the boundary's bytes per sample; with ``"auto"``
       (and with other exchange rates, drawn) it is those bytes plus the price of every
       candidate stage 2 redoes and of every priced frozen weight it holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.artifacts import Taint
from graphsplit.planning.cut.boundary import (
    cheapest_cut,
    facts,
    is_banned,
    is_storable,
    storage_cost,
)
from graphsplit.planning.cut.recompute import CostModel, Prices, candidates, price
from graphsplit.planning.rules.baked_sizes import is_fixed_number
from tests.helpers import batch, param_names

BATCH = 3
WIDTH = 4
# Brute force enumerates 2**k boundaries; steps with more candidate nodes are skipped.
MAX_CANDIDATES = 16

# op -> number of inputs. Ops with parameters draw whether those are frozen.
ARITY = {
    "frozen_or_trainable_linear": 1,
    "lora_linear": 1,  # frozen base(h) + trainable adapter(h): stage 2 has h anyway
    "add": 2,
    "mul": 2,
    "tanh": 1,
    "view_transpose_reshape": 1,  # cheap: no FLOPs, may be recomputed in stage 2
    "cat": 1,  # cheap, doubles the width (makes storing the input cheaper)
    "narrow": 1,  # cheap, halves the width
    "randn_like_add": 1,  # random
    "dropout_train": 1,  # random
    "batch_mean": 1,  # mixes samples: h - h.mean(0)
    "dataset_constant_add": 1,  # h + tanh(c @ m) from parameters only: no batch dim
    # Reads a size off a second value: stage 2 needs a number, not that value's tensor.
    "scale_by_width": 2,  # h * (g.shape[1] // 2 + 1), g any earlier value, x included
    "noise_shaped_by": 2,  # h + a draw of shape (h.shape[0], g.shape[1]), averaged over dim 1
}
SIZE_READERS = {"scale_by_width", "noise_shaped_by"}
HAS_PARAMS = {"frozen_or_trainable_linear", "dataset_constant_add"}  # may be frozen
FROZEN_FORMS = ("requires_grad", "prefixes", "modules", "predicate")


@dataclass(frozen=True)
class Op:
    kind: str
    inputs: tuple[int, ...]
    width: int  # width of this node's output
    frozen: bool = False


@dataclass(frozen=True)
class StepSpec:
    ops: tuple[Op, ...]
    outputs: tuple[int, ...]  # node indices (0 is x) summed into the prediction
    loss: str  # "mse" against a target y, or "mean" of the raw prediction
    frozen_form: str
    recompute: str = "auto"


def _allowed(kind: str, width: int) -> bool:
    if kind == "cat":
        return width <= 8
    if kind in ("narrow", "view_transpose_reshape"):
        return width >= 2 and width % 2 == 0
    return True


@st.composite
def step_specs(draw: st.DrawFn) -> StepSpec:
    widths = [WIDTH]
    ops: list[Op] = []
    # Half the steps encode the batch with a frozen layer first (where a VAE sits) and read
    # the raw batch afterwards only for its size: stage 2 then needs a number, not ``x``.
    if draw(st.booleans()):
        ops.append(Op("frozen_or_trainable_linear", (0,), draw(st.sampled_from((2, 4, 8))), True))
        widths.append(ops[0].width)
    lowest = len(ops)  # the first input an op other than a size reader may read
    for index in range(len(ops) + 1, len(ops) + draw(st.integers(1, 11)) + 1):
        first = draw(st.integers(lowest, index - 1))
        width = widths[first]
        kind = draw(st.sampled_from([k for k in ARITY if _allowed(k, width)]))
        inputs: tuple[int, ...] = (first,)
        if kind in SIZE_READERS:
            inputs = (first, draw(st.integers(0, index - 1)))
        elif ARITY[kind] == 2:
            same_width = [j for j in range(lowest, index) if widths[j] == width]
            inputs = (first, draw(st.sampled_from(same_width)))
        if kind == "frozen_or_trainable_linear":
            width = draw(st.sampled_from((2, 4, 8)))
        elif kind == "lora_linear":
            width = draw(st.sampled_from((4, 8, 16)))
        elif kind == "cat":
            width *= 2
        elif kind == "narrow":
            width //= 2
        frozen = draw(st.booleans()) if kind in HAS_PARAMS else False
        ops.append(Op(kind, inputs, width, frozen))
        widths.append(width)
    used = {source for op in ops for source in op.inputs}
    sinks = [index for index in range(len(widths)) if index not in used]
    outputs = draw(st.lists(st.sampled_from(sinks), min_size=1, max_size=len(sinks), unique=True))
    return StepSpec(
        ops=tuple(ops),
        outputs=tuple(sorted(outputs)),
        loss=draw(st.sampled_from(("mse", "mean"))),
        frozen_form=draw(st.sampled_from(FROZEN_FORMS)),
        recompute=draw(st.sampled_from(("auto", "never"))),
    )


class GeneratedStep(nn.Module):
    """Runs a :class:`StepSpec`; node ``i``'s parameters live in submodule ``node{i}``."""

    def __init__(self, spec: StepSpec) -> None:
        super().__init__()
        self.spec = spec
        generator = torch.Generator().manual_seed(len(spec.ops))
        widths = [WIDTH] + [op.width for op in spec.ops]
        for index, op in enumerate(spec.ops, start=1):
            width_in = widths[op.inputs[0]]
            if op.kind == "frozen_or_trainable_linear":
                layer = nn.Linear(width_in, op.width)
            elif op.kind == "lora_linear":
                layer = nn.Module()
                layer.base = nn.Linear(width_in, op.width)
                layer.adapter = nn.Linear(width_in, op.width, bias=False)
            elif op.kind == "dataset_constant_add":
                layer = nn.Module()
                layer.c = nn.Parameter(torch.randn(width_in, generator=generator))
                layer.m = nn.Parameter(torch.randn(width_in, width_in, generator=generator))
            else:
                continue
            self.add_module(f"node{index}", layer)

    def forward(self, x, y):
        values = [x]
        for index, op in enumerate(self.spec.ops, start=1):
            values.append(self._apply(index, op, [values[i] for i in op.inputs]))
        prediction = sum(values[index].sum(1) for index in self.spec.outputs)
        if self.spec.loss == "mse":
            return F.mse_loss(prediction, y)
        return prediction.mean()

    def _apply(self, index: int, op: Op, inputs: list[torch.Tensor]) -> torch.Tensor:
        h = inputs[0]
        if op.kind == "frozen_or_trainable_linear":
            return getattr(self, f"node{index}")(h)
        if op.kind == "lora_linear":
            layer = getattr(self, f"node{index}")
            return layer.base(h) + layer.adapter(h)
        if op.kind == "add":
            return h + inputs[1]
        if op.kind == "mul":
            return h * inputs[1]
        if op.kind == "tanh":
            return torch.tanh(h)
        if op.kind == "view_transpose_reshape":
            return h.view(-1, 2, op.width // 2).transpose(1, 2).reshape(-1, op.width)
        if op.kind == "cat":
            return torch.cat([h, h], dim=1)
        if op.kind == "narrow":
            return h[:, : op.width]
        if op.kind == "randn_like_add":
            return h + torch.randn_like(h)
        if op.kind == "dropout_train":
            return F.dropout(h, p=0.5, training=True)
        if op.kind == "batch_mean":
            return h - h.mean(0)
        if op.kind == "dataset_constant_add":
            holder = getattr(self, f"node{index}")
            return h + torch.tanh(holder.c @ holder.m)
        if op.kind == "scale_by_width":
            return h * (inputs[1].shape[1] // 2 + 1)
        if op.kind == "noise_shaped_by":
            return h + torch.randn(h.shape[0], inputs[1].shape[1]).mean(1, keepdim=True)
        raise AssertionError(op.kind)


def build(spec: StepSpec) -> tuple[GeneratedStep, tuple[torch.Tensor, torch.Tensor], object]:
    """The model, an example batch, and the ``frozen=`` argument in the drawn form."""
    torch.manual_seed(0)
    model = GeneratedStep(spec)
    frozen_modules = [f"node{index}" for index, op in enumerate(spec.ops, start=1) if op.frozen]
    frozen_modules += [
        f"node{index}.base"
        for index, op in enumerate(spec.ops, start=1)
        if op.kind == "lora_linear"
    ]
    if spec.frozen_form == "requires_grad":
        for name in frozen_modules:
            model.get_submodule(name).requires_grad_(False)
        frozen = None
    elif spec.frozen_form == "prefixes":
        frozen = frozen_modules
    elif spec.frozen_form == "modules":
        frozen = [model.get_submodule(name) for name in frozen_modules]
    else:
        frozen = lambda name, param: name.rpartition(".")[0] in frozen_modules  # noqa: E731
    args = (batch(BATCH, WIDTH, seed=1), batch(BATCH, seed=2))
    return model, args, frozen


def split_spec(spec: StepSpec) -> tuple[GeneratedStep, tuple, graphsplit.Split]:
    model, args, frozen = build(spec)
    return model, args, graphsplit.split(model, args, frozen=frozen, recompute=spec.recompute)


# -- brute force ------------------------------------------------------------------------------
def _closure(starts: set[fx.Node], step) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    pending = list(starts)
    while pending:
        node = pending.pop()
        if node not in seen:
            seen.add(node)
            pending.extend(step(node))
    return seen


NO_PRICES = Prices(work={}, weights={}, readers={})


def plan_cost(boundary, stage2: set[fx.Node], prices: Prices) -> int:
    """Bytes per sample stored, plus what stage 2 pays to redo priced work and hold weights."""
    held = {name for name, readers in prices.readers.items() if stage2 & set(readers)}
    return (
        sum(storage_cost(node) for node in boundary)
        + sum(prices.work[node] for node in stage2 if node in prices.work)
        + sum(prices.weights[name] for name in held)
    )


def _required(graph: fx.Graph, taint: dict[fx.Node, Taint]) -> set[fx.Node]:
    """What stage 2 must compute: the output, and every random draw (it must happen in stage 2
    even when its value is unused). A tainted node neither reads runs nowhere: the cut drains
    only live tainted nodes to its sink."""
    output = next(node for node in graph.nodes if node.op == "output")
    return set(output.all_input_nodes) | {node for node in taint if facts(node).random_ops}


def _forbidden(graph: fx.Graph, taint: dict[fx.Node, Taint], prices: Prices) -> set[fx.Node]:
    """What stage 2 may not run at any price: inputs, and frozen work that is not priced."""
    return {
        n
        for n in graph.nodes
        if n.op == "placeholder" or (n.op != "output" and is_banned(n, taint))
        if n not in prices.work
    }


def stage2_walk(
    graph: fx.Graph, taint: dict[fx.Node, Taint], prices: Prices, boundary: set[fx.Node]
) -> set[fx.Node] | None:
    """What stage 2 runs for ``boundary`` -- walking back from what it must compute, stopping at
    boundary values, as ``planning.cut.stages_for`` does -- or None if that reaches a
    forbidden node."""
    forbidden = _forbidden(graph, taint, prices)
    # A batch size is read off any per-sample boundary tensor (``Cut.reanchored``).
    anchored = any("facts" in n.meta and facts(n).per_sample for n in boundary)
    seen: set[fx.Node] = set()
    pending = list(_required(graph, taint))
    while pending:
        node = pending.pop()
        if node in seen or node in boundary:
            continue
        if node in forbidden:
            return None
        seen.add(node)
        if not (anchored and node not in taint and facts(node).is_batch_size):
            pending.extend(node.all_input_nodes)
    return seen


def brute_force_optimum(graph: fx.Graph, taint: dict[fx.Node, Taint], prices: Prices) -> int:
    """The least cost of any valid boundary, by enumerating candidate sets.

    A set of storable nodes is a valid boundary when :func:`stage2_walk` finds one; its cost is
    :func:`plan_cost` of the boundary and that walk. Only storable nodes that lie between
    something stage 2 cannot run for free (an input, frozen work, a reader of a priced weight)
    and a required node can matter, so only those are enumerated.
    """
    nodes = [node for node in graph.nodes if node.op != "output"]
    free = {n for n in nodes if n.op == "placeholder" or is_banned(n, taint)}
    free |= {n for readers in prices.readers.values() for n in readers}
    upstream = _closure(_required(graph, taint), lambda node: node.all_input_nodes)
    downstream = _closure(free, lambda node: node.users)
    candidates = [
        node
        for node in nodes
        if (is_storable(node, taint) or is_fixed_number(node, taint))
        and node in upstream
        and node in downstream
    ]
    assume(len(candidates) <= MAX_CANDIDATES)
    best = None
    for size in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, size):
            stage2 = stage2_walk(graph, taint, prices, set(subset))
            if stage2 is not None:
                cost = plan_cost(subset, stage2, prices)
                best = cost if best is None else min(best, cost)
    assert best is not None, "no valid boundary: the inputs themselves always are one"
    return best


def chosen_cost(graph: fx.Graph, cut, prices: Prices) -> int:
    """The chosen plan's cost, counted as :func:`brute_force_optimum` counts every plan."""
    stage2 = stage2_walk(graph, cut.taint, prices, set(cut.boundary) | set(cut.baked))
    assert stage2 is not None, "the chosen boundary makes stage 2 run forbidden work"
    # Stage 2 may skip dead tainted work; never more, but for the size reads of a batch size
    # it reads off a tensor it has rather than off the anchor (``stages_for``'s choice).
    extra = set(cut.stage2) - stage2
    assert not [n.name for n in extra if n in cut.taint or facts(n).is_tensor]
    return plan_cost(cut.boundary, stage2, prices)


def prices_for(split: graphsplit.Split, model: nn.Module, costs: CostModel) -> Prices:
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    return price(split.graph, split.cut.taint, sizes, costs)


# -- properties ------------------------------------------------------------------------------
PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@PROPERTY_SETTINGS
@given(step_specs())
def test_verify_is_exact(spec):
    model, args, split = split_spec(spec)
    comparisons = graphsplit.verify(model, split, args)
    assert comparisons and all(comparison.ok for comparison in comparisons)


@PROPERTY_SETTINGS
@given(step_specs())
def test_each_stage_owns_what_it_must(spec):
    model, _, split = split_spec(spec)
    taint = split.cut.taint
    assert not param_names(split.stage1, model) & split.trainable
    assert not [node.name for node in split.cut.stage1 if node in taint]
    output = next(node for node in split.graph.nodes if node.op == "output")
    needed = _closure(set(output.all_input_nodes), lambda node: node.all_input_nodes)
    # Dead pure values may be dropped; a dead random draw may not (it moves the RNG stream).
    must_run = [node for node in taint if node in needed or facts(node).random_ops]
    assert not [node.name for node in must_run if node not in split.cut.stage2]
    redoable = candidates(split.graph, taint) if spec.recompute == "auto" else frozenset()
    redone = [node for node in split.cut.stage2 if is_banned(node, taint)]
    assert not [node.name for node in redone if node not in redoable]
    trade = split.cut.recomputation
    assert (trade.nodes if trade else ()) == tuple(n for n in split.graph.nodes if n in redone)


@PROPERTY_SETTINGS
@given(step_specs())
def test_plan_cost_is_optimal(spec):
    model, _, split = split_spec(spec)
    assert all(is_storable(node, split.cut.taint) for node in split.cut.boundary)
    assert all(is_fixed_number(node, split.cut.taint) for node in split.cut.baked)
    auto = spec.recompute == "auto"
    prices = prices_for(split, model, CostModel()) if auto else NO_PRICES
    # The min-cut's own choice: choose_boundary's later passes (sized constants, twin reads)
    # trade a stored constant or a baked literal for stage-2 reads, outside the cost model;
    # the other properties check the plan they make.
    cut = cheapest_cut(split.graph, split.trainable, recompute=spec.recompute, model=model)
    chosen = chosen_cost(split.graph, cut, prices)
    assert chosen == brute_force_optimum(split.graph, split.cut.taint, prices)


EXCHANGE_RATES = st.builds(
    CostModel,
    flops_per_byte=st.sampled_from((1, 8, 64, 4096)),
    weight_samples=st.sampled_from((1, 16, 256, 65536)),
)


@PROPERTY_SETTINGS
@given(step_specs(), EXCHANGE_RATES)
def test_plan_cost_is_optimal_at_any_exchange_rate(spec, costs):
    model, _, split = split_spec(spec)
    cut = cheapest_cut(split.graph, split.trainable, recompute="auto", model=model, costs=costs)
    prices = prices_for(split, model, costs)
    optimum = brute_force_optimum(split.graph, cut.taint, prices)
    assert chosen_cost(split.graph, cut, prices) == optimum
