"""Keep activation checkpointing: a checkpointed call traced through is checkpointed in stage 2.

The tracer runs ``torch.utils.checkpoint.checkpoint(fn, *args)`` by tracing ``fn(*args)``
(the graph holds what ``fn`` computes, not the checkpoint), and tags every node it creates
meanwhile with the call's :class:`CheckpointRegion` (``node.meta["checkpoint"]``, see
:func:`graphsplit.planning.patches.checkpoints_recorded`). Without this pass, stage 2 would run
those nodes plainly: same numbers, but every activation of every DiT block kept for backward.

Glossary:
    checkpoint region: the nodes one ``checkpoint`` call traced, and the options it was called
        with (``use_reentrant``, ``preserve_rng_state``, ...), passed on unchanged.
    module region: a region whose stage-2 part is exactly one call of a module, which is how
        DiffSynth (``checkpoint(create_custom_forward(block), x, ..., use_reentrant=False)``)
        and diffusers (``checkpoint(block.__call__, ...)``) write it. Stage 2 then reads
        ``checkpoint(self.blocks[0], x, ..., use_reentrant=False)``: the block's own forward,
        hooks and LoRA layers, recomputed in backward as the step did it.

Regions of other shapes (several modules and ops inside one ``fn``), and regions whose work
was cached by stage 1, are left as traced.

In: the traced graph, the cut, the stage-2 graph being built and its node map. Out: the same
stage-2 graph, module regions replaced by checkpoint calls:

    recheckpoint(stage, graph, cut, env) -> None
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.utils.checkpoint

from graphsplit.artifacts import Cut

# Where the tracer tags the nodes traced inside a checkpoint() call.
CHECKPOINT = "checkpoint"
# The real function (the tracer replaces the module attribute while it runs).
_CHECKPOINT = torch.utils.checkpoint.checkpoint


@dataclass(frozen=True, eq=False)
class CheckpointRegion:
    """One traced ``checkpoint()`` call: its index in the step and its keyword options."""

    index: int
    options: dict[str, Any] = field(default_factory=dict)


def recheckpoint(stage: fx.Graph, graph: fx.Graph, cut: Cut, env: dict[fx.Node, fx.Node]) -> None:
    """Replace each module region stage 2 runs by a ``checkpoint`` call of that module."""
    regions: dict[CheckpointRegion, list[fx.Node]] = {}
    for node in graph.nodes:
        region = node.meta.get(CHECKPOINT)
        if region is not None:
            regions.setdefault(region, []).append(node)
    for region, nodes in regions.items():
        call = _module_call(nodes, cut)
        if call is not None:
            env[call] = _checkpointed(stage, env[call], region)


def _module_call(nodes: list[fx.Node], cut: Cut) -> fx.Node | None:
    """The region's one module call, if stage 2 runs it and nothing else of the region."""
    boundary = set(cut.boundary)
    if any(node in boundary or node not in cut.stage2 for node in nodes):
        return None  # (part of) the region's work was cached: stage 2 has no whole call
    if len(nodes) != 1 or nodes[0].op != "call_module":
        return None
    return nodes[0]


def _checkpointed(stage: fx.Graph, call: fx.Node, region: CheckpointRegion) -> fx.Node:
    """``self.block(*args, **kwargs)`` -> ``checkpoint(self.block, *args, **kwargs, **opts)``."""
    with stage.inserting_before(call):
        module = stage.create_node("get_attr", call.target, name=f"{call.name}_module")
        module.meta = {"val": None, "source": call.meta.get("source")}
        kwargs = {**call.kwargs, **region.options}
        replacement = stage.create_node(
            "call_function",
            _CHECKPOINT,
            (module, *call.args),
            kwargs,
            name=f"{call.name}_checkpointed",
        )
    replacement.meta = dict(call.meta)
    call.replace_all_uses_with(replacement)
    stage.erase_node(call)
    return replacement
