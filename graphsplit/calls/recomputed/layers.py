"""Which cached calls stage 2 should redo instead of reading their outputs from the cache.

The module-level path caches every frozen call whose inputs are a function of the sample
alone, down to a LoRA'd layer's base projection inside the trainable model: a diffusion
model's cross-attention keys and values, computed from the text embedding by one frozen linear
layer each, are then stored for every block, many times the bytes of the embedding they are
computed from. With ``recompute="auto"`` the whole-step trace prices such a layer
(:mod:`graphsplit.planning.cut.recompute`: FLOPs and held weights in byte-equivalents per
sample) and redoes it in stage 2 where that is cheaper; this module makes the same trade for
the module-level path, at the level of calls, with the same prices.

Glossary:
    candidate: a cached call of one layer (a module with parameters and no submodule holding
        any: a base projection, a norm, an embedding). Stage 2 runs the step's own code anyway,
        so redoing the layer needs no other frozen work: only what it takes, which the usage
        analysis then finds stage 2 reading, so the cache stores it (``stored_bytes`` counts
        it). Exactness never depends on which calls are candidates; the price does.
    sources: the output fields of other cached calls (``(call, field)``) and the step's
        inputs (by name) a candidate's torch calls take, in both probes alike (the call
        itself where it takes none of them).
    group: the candidates taking the same sources (every key and value projection of one
        text embedding): redone together or not at all, since their sources are stored once
        for all of them.
    stored bytes: the bytes per sample the cache holds for a set of cached calls (their fields
        stage 2 reads, the inputs it computes with), counted by the caller, which knows how.
    price: byte-equivalents per sample of redoing a group: its FLOPs per sample over
        ``flops_per_byte`` plus each weight it reads over ``weight_samples``, once a weight.

A group is redone when the stored bytes it saves exceed its price; at least one cached call
always stays (a module-level split caches something). Redoing is exact by construction: stage
2 runs the same layer on the same values the cache gives it, as the unsplit step did.

    redone_calls(candidates, probes, usages, modules, roots, batch_size, stored_bytes,
                 costs=AUTO) -> Redone
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from graphsplit.calls.module_calls import CallId
from graphsplit.calls.usage import Usage
from graphsplit.planning.cut.recompute import AUTO, CostModel

Source = tuple[CallId, str] | str


@dataclass(frozen=True)
class Trade:
    """One group's trade: the bytes per sample it saves and its price."""

    calls: tuple[CallId, ...]
    saved: int
    price: int


@dataclass(frozen=True)
class Redone:
    """The calls stage 2 redoes (``calls``) and each group's trade; ``declined``: the groups
    whose trade did not pay (kept cached), for the report."""

    calls: frozenset[CallId] = frozenset()
    trades: tuple[Trade, ...] = ()
    declined: tuple[Trade, ...] = field(default=())

    def trade_of(self, call: CallId) -> Trade | None:
        return next((trade for trade in self.trades if call in trade.calls), None)


def redone_calls(
    candidates: set[CallId],
    probes: list[Any],
    usages: list[Usage],
    modules: Mapping[str, nn.Module],
    roots: Mapping[str, torch.Tensor],
    batch_size: int,
    stored_bytes: Callable[[set[CallId]], int],
    costs: CostModel = AUTO,
) -> Redone:
    """The groups of candidates worth redoing in stage 2, decided one group at a time in the
    step's order (``stored_bytes(cached)``: the cache's bytes per sample for those cached)."""
    groups: dict[frozenset[Source], list[CallId]] = {}
    for call in candidates:
        sources = _sources(call, candidates, probes, usages, modules.get(call[0]), roots)
        if sources is not None:
            groups.setdefault(sources, []).append(call)
    order = {call: index for index, call in enumerate(probes[0].calls)}
    cached = set(candidates)
    before = stored_bytes(cached) if groups else 0
    trades, declined = [], []
    for calls in sorted(groups.values(), key=lambda group: min(order[c] for c in group)):
        calls = sorted(calls, key=order.__getitem__)
        trial = cached - set(calls)
        if not trial:  # a module-level split caches at least one call
            continue
        after = stored_bytes(trial)
        trade = Trade(
            tuple(calls), before - after, _price(calls, probes[0], modules, batch_size, costs)
        )
        if trade.saved > trade.price:
            cached, before = trial, after
            trades.append(trade)
        else:
            declined.append(trade)
    redone = frozenset(call for trade in trades for call in trade.calls)
    return Redone(redone, tuple(trades), tuple(declined))


def _one_layer(module: nn.Module | None) -> bool:
    """A module with parameters of its own and no submodule holding any; not one in training
    mode with buffers (a batch norm's running statistics: running it again to count its FLOPs
    would move them)."""
    if module is None or next(module.parameters(recurse=False), None) is None:
        return False
    if module.training and next(module.buffers(), None) is not None:
        return False
    return all(
        next(child.parameters(recurse=False), None) is None
        for child in module.modules()
        if child is not module
    )


def _sources(
    call: CallId,
    cached: set[CallId],
    probes: list[Any],
    usages: list[Usage],
    module: nn.Module | None,
    roots: Mapping[str, torch.Tensor],
) -> frozenset[Source] | None:
    """What ``call`` takes, the same in every probe, when it is a candidate (else None)."""
    if not _one_layer(module):
        return None
    assert module is not None
    own = {id(tensor) for tensor in itertools.chain(module.parameters(), module.buffers())}
    found: set[frozenset[Source]] = set()
    for probe, usage in zip(probes, usages):
        if call not in probe.calls:
            return None
        # Only outputs made before the call: they are alive while it runs, so no temporary of
        # its own can have had their id (a later output may reuse a freed temporary's id).
        named: dict[int, Source] = {id(tensor): name for name, tensor in roots.items()}
        for other in itertools.takewhile(lambda made: made != call, probe.calls):
            if other in cached:
                for name, tensor in probe.calls[other].tensors.items():
                    named[id(tensor)] = (other, name)
        taken = usage.read.get(call, set()) - own
        found.add(frozenset(named[key] for key in taken if key in named) or frozenset([call]))
    return found.pop() if len(found) == 1 else None


def _price(
    calls: list[CallId],
    probe: Any,
    modules: Mapping[str, nn.Module],
    batch_size: int,
    costs: CostModel,
) -> int:
    """Byte-equivalents per sample of stage 2 redoing ``calls`` (FLOPs, then each weight once)."""
    flops = sum(_flops(modules[call[0]], probe.calls[call].inputs) for call in calls)
    weights = {
        id(tensor): tensor
        for call in calls
        for tensor in itertools.chain(modules[call[0]].parameters(), modules[call[0]].buffers())
    }
    held = sum(costs.weight_cost(t.numel() * t.element_size()) for t in weights.values())
    if math.isinf(flops):
        return sys.maxsize
    return costs.work_cost(flops / max(batch_size, 1)) + held


def _flops(module: nn.Module, inputs: Any) -> float:
    """The call's FLOPs, counted by running the layer once more on the probe's copy of its
    inputs (one layer: as cheap as the probe's own run of it). A layer that does not run so
    (a hook that wants more than its arguments) is priced out: infinitely many FLOPs."""
    args, kwargs = pytree.tree_unflatten(list(inputs.leaves), inputs.spec)
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            module(*args, **kwargs)
    except Exception:  # an optimisation's probe: the call stays cached, as without it
        return math.inf
    return int(counter.get_total_flops())
