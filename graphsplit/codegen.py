"""Generate stage 1 and stage 2 as ``torch.fx.GraphModule``s from a cut of the traced graph.

Stage 1 is the traced graph restricted to the ancestors of the boundary; it takes the step's
inputs and returns ``{key: tensor}``. Stage 2 is the graph from the boundary to the output; it
takes the boundary as keyword arguments and returns what the step returned. Each stage holds only
the attributes its nodes reference, as the *same objects* as the model (an optimizer built on the
model still works, checkpoints keep their names), so stage 2 never holds the frozen modules whose
work moved to stage 1 and they may stay on ``meta`` in a training process.

In: traced graph, :class:`~graphsplit.cut.Cut`, boundary keys, the model and trace constants.
Out: two GraphModules.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from graphsplit.cut import Cut
from graphsplit.errors import MetaParameterError
from graphsplit.trace import fetch


def _refuse_meta_tensors(stage: nn.Module, args: Any) -> None:
    """Forward pre-hook: a stage must not run while it holds a tensor on ``meta``."""
    for kind, tensors in (
        ("parameter", stage.named_parameters()),
        ("buffer", stage.named_buffers()),
    ):
        for name, tensor in tensors:
            if tensor.is_meta:
                raise MetaParameterError(
                    f"{type(stage).__name__} holds the {kind} {name!r} on the meta device, so it"
                    " cannot run.\n"
                    "  fix:    load real weights into the modules this stage uses (e.g. "
                    "load_state_dict(..., assign=True) or build them on a real device); "
                    "graphsplit only leaves the *other* stage's modules on meta"
                )


def _module(
    graph: fx.Graph, model: nn.Module, constants: dict[str, Any], name: str
) -> fx.GraphModule:
    targets = sorted(
        {node.target for node in graph.nodes if node.op in ("get_attr", "call_module")},
        key=lambda target: (target.count("."), target),
    )
    root = {target: fetch(model, constants, target) for target in targets}
    stage = fx.GraphModule(root, graph, class_name=name)
    stage.register_forward_pre_hook(_refuse_meta_tensors)
    return stage


def build_stage1(
    graph: fx.Graph, cut: Cut, keys: list[str], model: nn.Module, constants: dict[str, Any]
) -> fx.GraphModule:
    """Inputs -> ``{key: boundary tensor}``."""
    stage = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in cut.stage1:
            env[node] = stage.node_copy(node, env.__getitem__)
    stage.output({key: env[node] for key, node in zip(keys, cut.boundary)})
    return _module(stage, model, constants, "Stage1")


def build_stage2(
    graph: fx.Graph, cut: Cut, keys: list[str], model: nn.Module, constants: dict[str, Any]
) -> fx.GraphModule:
    """``**boundary`` -> what the step returned."""
    stage = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for key, node in zip(keys, cut.boundary):
        env[node] = stage.placeholder(key)
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node in cut.reanchored:
            # The batch size, read off a cached tensor instead of the input it came from.
            batch_dim = cut.anchor.meta["facts"].batch_dim
            env[node] = stage.create_node(
                "call_method", "size", (env[cut.anchor], batch_dim), name=node.name
            )
            env[node].meta = dict(node.meta)
        elif node in cut.stage2 or node.op == "output":
            env[node] = stage.node_copy(node, env.__getitem__)
    return _module(stage, model, constants, "Stage2")
