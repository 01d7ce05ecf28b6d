"""Store or recompute: the prices that let stage 2 redo a frozen layer instead of caching it.

Glossary:
    frozen work: untainted work that runs FLOPs or calls a module owning frozen parameters
        (:func:`~graphsplit.planning.cut.boundary.is_banned`). With ``recompute="never"`` stage 2
        never redoes it, so its output is cached even when it is many times the bytes of its input.
    candidate: frozen work that ``recompute="auto"`` lets stage 2 redo, at a price. It must be
        one layer (a module with no parameter-holding submodules, or a single function such as
        a matmul), and its inputs must already be on the boundary: each nearest frozen or input
        value it reads (through cheap, FLOP-free work) is a step input or a value stage 2 reads
        anyway (a tainted node or an output reads it through cheap work). A whole encoder is
        never a candidate, nor is a layer whose input only frozen work reads.
    byte-equivalent: the cut's one currency, a byte stored per sample. A candidate costs its
        FLOPs per sample over :attr:`CostModel.flops_per_byte`; each frozen parameter stage 2
        must then hold costs its bytes over :attr:`CostModel.weight_samples`, once however many
        candidates read it. Both round up, so every price is a whole number of bytes.

The exchange rates (:data:`AUTO`), and why:
    flops_per_byte = 4096: stage 2 reads a stored byte from the cache every epoch (disk or page
        cache -> host -> device at 2-7 GB/s) while the accelerator it trains on runs 50-1000
        TFLOP/s, so one byte read costs the time of 1e4-1e5 FLOPs. 4096 is below that range:
        recomputation must win clearly, and a frozen linear layer is redone only when its input
        width is under ~8k (fp32; ~4k in bf16). Real encoders run 1e4-1e6 FLOPs per output
        byte, so they are stored at any size.
    weight_samples = 65536: a weight is held once per training process; a boundary byte is
        written for every sample and read every epoch. Charging a weight as if it were stored
        for 2**16 samples (fine-tuning sets run from thousands to millions) means a label
        embedding table or a LoRA'd layer's base projection is worth holding, not a model.

In: the graph with ``meta["facts"]``, its taint, the model's parameter sizes.
Out: :class:`Prices` (what each candidate and each frozen weight costs, in byte-equivalents):

    price(graph, taint, weight_bytes, costs) -> Prices
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from graphsplit.artifacts import Taint
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.node_inputs import reads_through
from graphsplit.planning.rules.opaque_call import is_opaque
from graphsplit.planning.rules.taint import facts, is_banned, module_owner

Recompute = Literal["auto", "never"]
RECOMPUTE_CHOICES = ("auto", "never")


@dataclass(frozen=True)
class CostModel:
    """The exchange rates into byte-equivalents per sample (see the module docstring)."""

    flops_per_byte: int = 4096
    weight_samples: int = 65536

    def work_cost(self, flops_per_sample: float) -> int:
        """Byte-equivalents per sample of redoing ``flops_per_sample`` FLOPs in stage 2."""
        return math.ceil(flops_per_sample / self.flops_per_byte)

    def weight_cost(self, nbytes: int) -> int:
        """Byte-equivalents per sample of stage 2 holding a frozen weight of ``nbytes``."""
        return math.ceil(nbytes / self.weight_samples)


AUTO = CostModel()


@dataclass(frozen=True)
class Prices:
    """What recomputing costs, in byte-equivalents per sample.

    ``work[v]``: redoing candidate ``v`` in stage 2. ``weights[name]``: stage 2 holding frozen
    parameter ``name`` (only the ones some candidate reads are priced); ``readers[name]``: every
    node that makes a stage hold it (``get_attr`` and ``call_module`` nodes).
    """

    work: Mapping[fx.Node, int]
    weights: Mapping[str, int]
    readers: Mapping[str, tuple[fx.Node, ...]]


def check_recompute(recompute: object) -> None:
    """Raise :class:`SplitError` unless ``recompute`` is one of :data:`RECOMPUTE_CHOICES`."""
    if recompute not in RECOMPUTE_CHOICES:
        raise user_error(
            SplitError,
            f"recompute={recompute!r} is not a choice.",
            fix=Fix(
                'pass recompute="never" (cache all frozen work; the default) or '
                'recompute="auto" (stage 2 may redo a frozen layer when that saves more cache than '
                "it costs)"
            ),
        )


def price(
    graph: fx.Graph,
    taint: Mapping[fx.Node, Taint],
    weight_bytes: Mapping[str, int],
    costs: CostModel = AUTO,
) -> Prices:
    """Price every candidate and the frozen weights the candidates read."""
    batch_size = traced_batch_size(graph)
    found = candidates(graph, taint)
    work = {node: costs.work_cost(facts(node).flops / batch_size) for node in found}
    priced = set().union(*(weights_read(node, taint) for node in found)) if found else set()
    readers: dict[str, list[fx.Node]] = {name: [] for name in priced}
    for node in graph.nodes:
        if "facts" in node.meta:
            for name in facts(node).params & priced:
                readers[name].append(node)
    weights = {name: costs.weight_cost(weight_bytes[name]) for name in sorted(priced)}
    return Prices(work, weights, {name: tuple(nodes) for name, nodes in readers.items()})


def candidates(graph: fx.Graph, taint: Mapping[fx.Node, Taint]) -> frozenset[fx.Node]:
    """Frozen work stage 2 may redo: one layer whose inputs are already on the boundary."""
    read_anyway = _read_by_stage2(graph, taint)
    return frozenset(
        node
        for node in graph.nodes
        if "facts" in node.meta
        and is_banned(node, taint)
        and not is_opaque(node)  # value-dependent code runs in stage 1 only
        and is_one_layer(node)
        and all(
            producer.op == "placeholder" or producer in read_anyway
            for producer in _frontier(node, taint)
        )
    )


def is_one_layer(node: fx.Node) -> bool:
    """A single function, or a call of a module none of whose submodules hold parameters."""
    owner = module_owner(node)
    if owner is None:
        return True
    prefix = f"{owner.target}."
    return all("." not in name.removeprefix(prefix) for name in facts(owner).params)


def traced_batch_size(graph: fx.Graph) -> int:
    """The batch size the facts were recorded at, read off any per-sample tensor."""
    for node in graph.nodes:
        node_facts = node.meta.get("facts")
        if node_facts is not None and node_facts.per_sample and node_facts.bytes_per_sample:
            return max(node_facts.total_bytes // node_facts.bytes_per_sample, 1)
    return 1


def _is_cheap(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> bool:
    """Untainted work stage 2 may redo for free today (views, additions, attribute reads)."""
    return node not in taint and node.op != "placeholder" and not is_banned(node, taint)


def _frontier(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> set[fx.Node]:
    """The nearest inputs and frozen work ``node`` reads, walking back through cheap work."""
    return reads_through(node, lambda producer: _is_cheap(producer, taint))[1]


def _read_by_stage2(graph: fx.Graph, taint: Mapping[fx.Node, Taint]) -> set[fx.Node]:
    """Untainted values stage 2 reads whatever the cut: the inputs of tainted nodes and of the
    output, and what those carry unchanged (walking back through cheap work with one batch
    input: views, casts, ``x + bias``; not through ``a + b``, which could be stored instead)."""
    output = next(node for node in graph.nodes if node.op == "output")
    pending = list(output.all_input_nodes)
    pending += [producer for node in taint for producer in node.all_input_nodes]
    found: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node in found or node in taint:
            continue
        found.add(node)
        batch_inputs = [producer for producer in node.all_input_nodes if _varies(producer)]
        if _is_cheap(node, taint) and len(batch_inputs) <= 1:
            pending.extend(batch_inputs)
    return found


def _varies(node: fx.Node) -> bool:
    """A tensor that changes with the batch (not a size, not a per-dataset constant)."""
    node_facts = facts(node)
    return node_facts.is_tensor and not node_facts.is_constant


def weights_read(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> set[str]:
    """Frozen parameters stage 2 must hold to redo ``node``: its module's, and those read by the
    cheap work between it and its frontier (``x @ self.weight.t()``)."""
    names: set[str] = set(facts(node).params)
    owner = module_owner(node)
    if owner is not None:
        names |= facts(owner).params
    seen: set[fx.Node] = set()
    pending = list(node.all_input_nodes)
    while pending:
        producer = pending.pop()
        if producer in seen or not _is_cheap(producer, taint):
            continue
        seen.add(producer)
        names |= facts(producer).params
        pending.extend(producer.all_input_nodes)
    return names
