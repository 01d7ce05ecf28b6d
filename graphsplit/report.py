"""Render a split's plan for humans (``report()``) and as JSON (``plan.json``).

    render_report(split, model) -> str
    plan_json(split) -> dict    # what Split.save_code writes as plan.json
    moved_work(split) -> MovedWork

``split`` is a :class:`SplitPlan`: what the report reads of a :class:`~graphsplit.api.Split`
(its stages, boundary and cut), named here so that this module sits below ``api`` and never
imports it; ``model`` is the model that was split (None when the split does not hold it).

The report answers what a careful user asks before trusting a plan: what is cached (and how
big per sample), which parameters each stage holds, how much frozen work leaves the training
step, which frozen work stage 2 redoes instead (the store-or-recompute trade: bytes saved per
sample against FLOPs and frozen weights added), which random draws stay in stage 2, and what
could not be cached and why.

Moved work is counted in matmul / convolution / attention FLOPs, from the meta analysis for
traced nodes and from the example run for an opaque call (frozen code that reads tensor values,
run eagerly by stage 1). An opaque call in which no op with a FLOP formula ran is *not counted*,
and the report says so by name instead of adding 0: its work may be Python reading tensor values
or code outside torch, which no counter sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import (
    BoundarySpec,
    Cut,
    MixingCause,
    PairedRows,
    Recomputation,
    Taint,
    TaintKind,
)
from graphsplit.planning.cut.boundary import facts, is_banned, module_owner
from graphsplit.planning.rules.opaque_call import OPAQUE, is_opaque
from graphsplit.planning.rules.size_guards import expression
from graphsplit.signatures.listing import signature_entries, signature_lines
from graphsplit.units import human_bytes, human_flops


class SplitPlan(Protocol):
    """What the report reads of a split (:class:`graphsplit.api.Split` is one)."""

    stage1: nn.Module
    stage2: nn.Module
    boundary: Mapping[str, BoundarySpec]
    input_names: tuple[str, ...]
    trainable: frozenset[str]
    graph: fx.Graph
    cut: Cut
    batch_sizes: tuple[int, int]
    model_name: str
    notes: list[str]
    paired_rows: PairedRows | None


def _param_summary(params: list[tuple[str, torch.Tensor]], trainable: frozenset[str]) -> str:
    frozen = [(n, p) for n, p in params if n not in trainable]
    train = [(n, p) for n, p in params if n in trainable]
    total = sum(p.numel() * p.element_size() for _, p in params)
    return (
        f"{len(params)} tensors, {human_bytes(total)} "
        f"({len(train)} trainable, {len(frozen)} frozen)"
    )


def _qualified(stage: nn.Module, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Stage parameters under the model's own names (stages keep the model's paths)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names.get(id(p), n), p) for n, p in stage.named_parameters()]


@dataclass(frozen=True)
class MovedWork:
    """The frozen work stage 1 runs and stage 2 does not.

    ``flops_per_sample``: the FLOPs counted; ``not_counted``: the opaque calls whose work is not
    in it (their nodes, in graph order), so that "0 FLOP" is never said of uncounted work.
    """

    flops_per_sample: int
    not_counted: tuple[fx.Node, ...]

    @property
    def known(self) -> bool:
        """Whether anything is counted, or nothing is left uncounted."""
        return self.flops_per_sample > 0 or not self.not_counted


def moved_work(split: SplitPlan) -> MovedWork:
    """FLOPs per sample that stage 1 runs and stage 2 does not, and the opaque calls not counted.

    An opaque node's analysis facts hold at least 1 FLOP (it is frozen work the cut must not
    move), so its own count, from the example run, is read instead.
    """
    moved = split.cut.stage1 - split.cut.stage2
    total, not_counted = 0, []
    for node in split.graph.nodes:
        if node not in moved:
            continue
        if not is_opaque(node):
            total += facts(node).flops
        elif node.meta[OPAQUE].flops > 0:
            total += node.meta[OPAQUE].flops
        else:
            not_counted.append(node)
    return MovedWork(total // max(split.batch_sizes[0], 1), tuple(not_counted))


def moved_work_lines(work: MovedWork) -> list[str]:
    """The report's lines on moved work; the opaque calls not counted by name, never as 0."""
    counted = f"{human_flops(work.flops_per_sample)} per sample (matmul/conv/attention FLOPs)"
    if not work.not_counted:
        return [f"Work moved out of the training step: {counted}"]
    calls = len(work.not_counted)
    head = f"{counted}, plus" if work.flops_per_sample else "unknown:"
    lines = [
        f"Work moved out of the training step: {head} the work of {calls} opaque "
        f"call{'s' if calls > 1 else ''} not counted (no op with a FLOP formula ran in "
        f"{'them' if calls > 1 else 'it'}: Python work on tensor values is not seen):"
    ]
    for node in work.not_counted:
        found = node.meta[OPAQUE]
        lines.append(f"  {node.name:<40} {found.label:<24} {node.meta.get('source', '')}")
    return lines


def _what(node: fx.Node) -> str:
    """What a node runs, for the report: the module path, or the function's name."""
    owner = module_owner(node)
    if owner is node:
        return str(node.target)
    if owner is not None:
        return f"{owner.target}.{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def recomputation_lines(trade: Recomputation | None) -> list[str]:
    """The store-or-recompute trade, or nothing when stage 2 redoes no frozen work."""
    if trade is None:
        return []
    lines = ["", 'Frozen work stage 2 redoes instead of caching it (recompute="auto"):']
    for node in trade.nodes:
        lines.append(f"  {node.name:<40} {_what(node):<24} {node.meta.get('source', '')}")
    if trade.bytes_saved_per_sample is None:
        saves = 'makes the split possible (recompute="never" finds no exact one)'
    else:
        saves = f"saves {human_bytes(trade.bytes_saved_per_sample)} per sample of cache"
    lines += [
        f"  {saves}; costs "
        f"{human_flops(trade.flops_per_sample)} per sample in stage 2 and "
        f"{human_bytes(trade.weight_bytes)} of frozen weights stage 2 now holds "
        f"({len(trade.weights)} tensors)",
    ]
    owners: dict[str, list[str]] = {}
    for name in trade.weights:
        owner, _, leaf = name.rpartition(".")
        owners.setdefault(owner, []).append(leaf)
    if owners:
        lines.append("  frozen weights stage 2 now holds (load them in the training process):")
    lines += [f"    {owner or '(model)'}: {', '.join(leaves)}" for owner, leaves in owners.items()]
    if trade.bytes_saved_per_sample is not None:
        lines.append('  (recompute="never" caches this work instead)')
    return lines


def recomputation_json(trade: Recomputation | None) -> dict[str, Any] | None:
    if trade is None:
        return None
    return {
        "nodes": [
            {"node": node.name, "runs": _what(node), "source": node.meta.get("source")}
            for node in trade.nodes
        ],
        "bytes_saved_per_sample": trade.bytes_saved_per_sample,
        "flops_per_sample": trade.flops_per_sample,
        "weights": list(trade.weights),
        "weight_bytes": trade.weight_bytes,
    }


def random_nodes(split: SplitPlan) -> list[fx.Node]:
    return [node for node in split.graph.nodes if node.op != "output" and facts(node).random_ops]


def uncached_roots(split: SplitPlan) -> list[tuple[fx.Node, Taint]]:
    """Values that would have been cacheable but for their own sample mixing, and frozen
    modules that draw random numbers, that stage 2 runs. Plain draws (``randn_like``) are listed
    as random draws. A node fed by a value stage 2 must compute anyway (a trainable head's loss
    averaged over the batch, then scaled) is no root: it could not be cached either way.
    """
    roots = []
    for node, taint in split.cut.taint.items():
        if node not in split.cut.stage2:  # dead work (a teacher's unread loss) runs nowhere
            continue
        own = taint.origin is node
        mixing = taint.kind is TaintKind.MIXING
        if own and (mixing or (taint.kind is TaintKind.RANDOM and is_banned(node, {}))):
            upstream = [split.cut.taint.get(producer) for producer in node.all_input_nodes]
            if not any(t is not None for t in upstream):
                roots.append((node, taint))
    return roots


def trap_hint(node: fx.Node, taint: Taint, trainable: frozenset[str]) -> str:
    """How to make a frozen module's random or mixing behaviour cacheable, if that's the cause."""
    owner = module_owner(node)
    if owner is None or not is_banned(node, {}):
        return ""
    params = facts(owner).params
    if not params or params & trainable:
        return ""
    if taint.kind is TaintKind.RANDOM:
        return (
            f"frozen module {owner.target} draws random numbers (dropout active in train "
            f"mode?); call {owner.target}.eval() to make it cacheable"
        )
    if taint.mixing is not None and taint.mixing.cause is MixingCause.BATCH_NORM_TRAINING:
        return (
            f"frozen module {owner.target} mixes samples (BatchNorm in train mode normalises "
            f"across the batch and updates running stats); call {owner.target}.eval() to make "
            "it cacheable"
        )
    return (
        f"frozen module {owner.target} was judged to mix samples of the batch; if it treats "
        "samples independently, please report this plan"
    )


def render_report(split: SplitPlan, model: nn.Module | None) -> str:
    """The plan for a human; ``model`` (the model that was split) adds the parameters table."""
    if split.batch_sizes == (1, 1):
        traced_at = "traced at batch 1: one sample per batch"
    else:
        traced_at = (
            f"traced at batch {split.batch_sizes[0]}, batch dims checked at batch "
            f"{split.batch_sizes[1]}"
        )
    lines = [f"graphsplit plan for {split.model_name} ({traced_at})", ""]
    per_sample = sum(spec.bytes_per_sample for spec in split.boundary.values())
    lines.append(f"Boundary: {len(split.boundary)} tensors, {human_bytes(per_sample)} per sample")
    lines.append(f"  {'name':<40} {'shape':<22} {'dtype':<9} {'batch':<6} {'/sample':<10} source")
    for spec in split.boundary.values():
        batch = "const" if spec.batch_dim is None else str(spec.batch_dim)
        dtype = str(spec.dtype).removeprefix("torch.")
        lines.append(
            f"  {spec.name:<40} {spec.shape!s:<22} {dtype:<9} {batch:<6} "
            f"{human_bytes(spec.bytes_per_sample):<10} {spec.source}"
        )
    lines += constant_lines(split.boundary)
    lines += baked_lines(split.cut)
    lines += twin_read_lines(split.cut)
    lines += signature_lines(split)
    if model is not None:
        stage1 = _qualified(split.stage1, model)
        stage2 = _qualified(split.stage2, model)
        in_stage2 = {n for n, _ in stage2}
        not_needed = [
            (n, p)
            for n, p in model.named_parameters()
            if n not in split.trainable and n not in in_stage2
        ]
        lines += [
            "",
            "Parameters",
            f"  stage 1: {_param_summary(stage1, split.trainable)}",
            f"  stage 2: {_param_summary(stage2, split.trainable)}",
            f"  frozen parameters stage 2 does not need: {len(not_needed)} tensors, "
            f"{human_bytes(sum(p.numel() * p.element_size() for _, p in not_needed))}",
        ]
    lines += ["", *moved_work_lines(moved_work(split))]
    lines += recomputation_lines(split.cut.recomputation)
    randoms = random_nodes(split)
    if randoms:
        lines += ["", "Random draws kept in stage 2 (same order as the original step):"]
        for node in randoms:
            ops = ", ".join(f"aten.{op}" for op in facts(node).random_ops)
            lines.append(f"  {node.name:<40} {ops:<24} {node.meta.get('source', '')}")
    roots = uncached_roots(split)
    if roots:
        lines += ["", "Not cached (frozen work that stays in stage 2):"]
        for node, taint in roots:
            lines.append(f"  {node.name:<40} {taint.reason}  {node.meta.get('source', '')}")
            hint = trap_hint(node, taint, split.trainable)
            if hint:
                lines.append(f"  {'':<40} hint: {hint}")
    if split.paired_rows is not None:
        lines += split.paired_rows.report_lines()
    if split.notes:
        lines += ["", "Notes:"] + [f"  {note}" for note in split.notes]
    return "\n".join(lines)


def constant_lines(boundary: Mapping[str, BoundarySpec]) -> list[str]:
    """The per-dataset constants: frozen work that reads no batch input, computed once."""
    constants = [spec for spec in boundary.values() if spec.is_constant]
    if not constants:
        return []
    total = sum(_constant_bytes(spec) for spec in constants)
    lines = [
        "",
        f"Per-dataset constants (read no batch input: cached once, not per sample; stage 2 "
        f"neither holds nor runs the frozen work behind them): {len(constants)} tensors, "
        f"{human_bytes(total)}",
    ]
    for spec in constants:
        lines.append(f"  {spec.name:<40} {human_bytes(_constant_bytes(spec)):<10} {spec.source}")
    return lines


def _constant_bytes(spec: BoundarySpec) -> int:
    count = 1
    for size in spec.shape:
        count *= size
    return count * spec.dtype.itemsize


def baked_lines(cut: Cut) -> list[str]:
    """The numbers stage 2 holds as literals instead of caching what they were read from."""
    if not cut.baked:
        return []
    lines = ["", "Numbers baked into stage 2 (not cached; stage 1 checks them on every batch):"]
    for node, value in cut.baked.items():
        lines.append(
            f"  {node.name:<40} {expression(node) + ' = ' + str(value):<34} "
            f"{node.meta.get('source', '')}"
        )
    return lines


def twin_read_lines(cut: Cut) -> list[str]:
    """The sizes and devices stage 2 reads off a cached tensor in place of a frozen output it
    does not have (:mod:`graphsplit.planning.cut.twin_reads`), and the numbers it reads as a
    size of one (:mod:`graphsplit.planning.cut.number_twins`)."""
    if not cut.twin_reads and not cut.number_twins:
        return []
    lines = ["", "Sizes stage 2 reads off a cached tensor (stage 1 checks on every batch):"]
    for read, twin in cut.twin_reads.items():
        lines.append(
            f"  {expression(read):<40} {'read off ' + twin.name:<34} {read.meta.get('source', '')}"
        )
    # Numbers read as a size of a twin (graphsplit.planning.cut.number_twins).
    for number, (twin, dim) in cut.number_twins.items():
        off = f"read as {twin.name}.shape[{dim}]"
        lines.append(f"  {expression(number):<40} {off:<34} {number.meta.get('source', '')}")
    return lines


def plan_json(split: SplitPlan) -> dict[str, Any]:
    work = moved_work(split)
    return {
        "model": split.model_name,
        "batch_sizes": list(split.batch_sizes),
        "inputs": list(split.input_names),
        "boundary": [spec.to_json() for spec in split.boundary.values()],
        "stage1_nodes": [n.name for n in split.graph.nodes if n in split.cut.stage1],
        "stage2_nodes": [n.name for n in split.graph.nodes if n in split.cut.stage2],
        # None when the only work moved is opaque calls whose work is not counted.
        "moved_flops_per_sample": work.flops_per_sample if work.known else None,
        "moved_work_not_counted": [
            {"node": n.name, "runs": n.meta[OPAQUE].label, "source": n.meta.get("source")}
            for n in work.not_counted
        ],
        "recomputed": recomputation_json(split.cut.recomputation),
        "signatures": signature_entries(split),
        "paired_rows": None if split.paired_rows is None else split.paired_rows.to_json(),
        "baked_numbers": [
            {
                "node": node.name,
                "expression": expression(node),
                "value": list(value) if isinstance(value, tuple) else value,
                "source": node.meta.get("source"),
            }
            for node, value in split.cut.baked.items()
        ],
        "random": [
            {"node": n.name, "ops": list(facts(n).random_ops), "source": n.meta.get("source")}
            for n in random_nodes(split)
        ],
        "not_cached": [
            {
                "node": n.name,
                "reason": t.reason,
                "source": n.meta.get("source"),
                "hint": trap_hint(n, t, split.trainable),
            }
            for n, t in uncached_roots(split)
        ],
        "notes": list(split.notes),
    }
