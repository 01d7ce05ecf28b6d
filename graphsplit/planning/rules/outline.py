"""Outline nodes of a stage into a small ``fx.GraphModule`` the stage calls as one value.

Stage 2 checkpoints a traced ``checkpoint(fn, ...)`` region by handing ``checkpoint`` one
callable that computes the region: the region's nodes, moved out of the stage's graph into a
graph of their own (:mod:`graphsplit.planning.rules.checkpoint` decides which nodes and how the
call reads).

Glossary:
    members: the stage nodes to outline, in graph order.
    region inputs: the values members read from outside the members, in graph order: they
        become the region's placeholders, named as in the stage. ``get_attr`` nodes are not
        inputs: the region reads the same attribute itself (``self.blocks[0]``), so a
        parameter never crosses the call as an argument.
    region outputs: members used after the region; the region returns the one output as it
        is, several as a tuple the stage unpacks with ``getitem``.
    region module: :class:`OutlinedRegion`, a GraphModule that owns no parameters, buffers or
        submodules: every attribute its code reads resolves on the stage, so it shares the
        stage's modules and parameters by reference (``stage.to(device)`` moves them for
        both, the stage's state dict keeps the model's keys, and an optimizer built on the
        stage's parameters trains what the region runs). It deep-copies with its stage (an
        EMA copy of stage 2 works); pickling it is refused, since fx would rebuild the stage
        by tracing its code again, through the checkpoint.

In: the stage, its member nodes, an attribute name, and ``wrap(graph, region, inputs)`` that
writes the call of the region (``checkpoint(region, *inputs, ...)``) into the stage's graph.
Out: the region module, registered on the stage as ``name``; the stage's graph calls it in
place of the members and is recompiled by the caller:

    outline(stage, members, name, wrap) -> OutlinedRegion
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch import nn

from graphsplit.errors import Fix, SplitError, user_error

# Writes the stage's call of the region: (stage graph, get_attr of the region, inputs) -> node.
Wrap = Callable[[fx.Graph, fx.Node, tuple[fx.Node, ...]], fx.Node]

# What to do instead of pickling a stage 2 that checkpoints (its code cannot be traced again).
SAVE_STAGE2_FIX = Fix(
    "save stage 2's state_dict() (or the model's) and build the split again with "
    "graphsplit.split(...) when loading, or write its code with split.save_code(folder)"
)


class OutlinedRegion(fx.GraphModule):
    """A GraphModule whose code reads its attributes from the stage that holds it.

    It is built without copying anything (fx's own constructor would copy the attributes the
    code reads into it), holds the stage as a plain reference (not a submodule: no cycle in the
    module tree), and deep-copies with the stage it belongs to (an EMA copy of stage 2 works).
    """

    def __init__(self, stage: fx.GraphModule | None, graph: fx.Graph, class_name: str) -> None:
        super().__init__(nn.Module(), fx.Graph(), class_name=class_name)
        object.__setattr__(self, "_stage", stage)
        self.graph = graph  # compiles the region's code

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            stage = self.__dict__.get("_stage")
            if stage is None:
                raise
            return getattr(stage, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> OutlinedRegion:
        copied = _empty_region(type(self).__name__)
        memo[id(self)] = copied  # the stage's copy refers back to this one
        stage = copy.deepcopy(self.__dict__["_stage"], memo)
        object.__setattr__(copied, "_stage", stage)
        copied.graph = copy.deepcopy(self.graph, memo)
        copied.training = self.training
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        # fx pickles a GraphModule as its code and traces that code again when loading: the
        # stage's checkpoint() calls would be traced through (checkpointing silently gone), and
        # this module would be called before its stage exists.
        raise user_error(
            SplitError,
            f"Stage 2 cannot be pickled: its checkpointed region {type(self).__name__} refers "
            "to the stage, and fx rebuilds a pickled stage by tracing its code again, which "
            "would run the region without checkpointing.",
            fix=SAVE_STAGE2_FIX,
        )


def _empty_region(class_name: str) -> OutlinedRegion:
    return OutlinedRegion(None, fx.Graph(), class_name)


def outline(stage: fx.GraphModule, members: list[fx.Node], name: str, wrap: Wrap) -> OutlinedRegion:
    """Move ``members`` into a region module; the stage calls it through ``wrap``."""
    graph = stage.graph
    inside = set(members)
    inputs = _inputs(members, inside)
    outputs = [node for node in members if any(user not in inside for user in node.users)]
    later = _nodes_after_the_region(graph, members, inside)
    region = OutlinedRegion(stage, _region_graph(members, inputs, outputs), _class_name(name))
    stage.add_module(name, region)

    with graph.inserting_after(members[-1]):
        attribute = graph.get_attr(name)
    with graph.inserting_after(attribute):
        call = wrap(graph, attribute, inputs)
    call.meta = {"source": members[-1].meta.get("source")}
    # Named after what it returns: the region's one output, or its outputs' tuple.
    call._rename(f"{outputs[0].name}_out" if len(outputs) == 1 else f"{name}_outputs")
    cursor = call
    replacements = {outputs[0]: call} if len(outputs) == 1 else {}
    for index, output in enumerate(outputs if len(outputs) > 1 else ()):
        with graph.inserting_after(cursor):
            cursor = graph.create_node(
                "call_function", operator.getitem, (call, index), name=f"{output.name}_out"
            )
        cursor.meta = dict(output.meta)
        replacements[output] = cursor
    for output, replacement in replacements.items():
        output.replace_all_uses_with(replacement, delete_user_cb=lambda user: user not in inside)
    for node in later:  # they read the region's outputs, so they now follow its call
        cursor.append(node)
        cursor = node
    for node in reversed(members):
        if not node.users:  # a get_attr member the stage still reads stays
            graph.erase_node(node)
    return region


def _inputs(members: list[fx.Node], inside: set[fx.Node]) -> tuple[fx.Node, ...]:
    found: dict[fx.Node, None] = {}
    for node in members:
        for value in node.all_input_nodes:
            if value not in inside and value.op != "get_attr":
                found[value] = None
    return tuple(found)


def _nodes_after_the_region(
    graph: fx.Graph, members: list[fx.Node], inside: set[fx.Node]
) -> list[fx.Node]:
    """Nodes between the members that read a member (directly or through such a node).

    They must move after the region's call. A member reading one of them would make the
    region a non-contiguous piece of the program, which cannot be one call.
    """
    later: list[fx.Node] = []
    moving: set[fx.Node] = set()
    started = False
    for node in graph.nodes:
        if node is members[0]:
            started = True
        if not started:
            continue
        if node in inside:
            blocker = next((value for value in node.all_input_nodes if value in moving), None)
            if blocker is not None:
                raise user_error(
                    SplitError,
                    f"Stage 2 cannot run the checkpointed code around {node.name} as one call: "
                    f"it reads {blocker.name}, computed outside the checkpoint from values "
                    "computed inside it.",
                    node=node,
                    fix=Fix(
                        "checkpoint a function that takes what it needs as arguments (or one "
                        "module), and please report the step"
                    ),
                )
            if node is members[-1]:
                break
            continue
        if any(value in inside or value in moving for value in node.all_input_nodes):
            later.append(node)
            moving.add(node)
    return later


def _region_graph(
    members: list[fx.Node], inputs: tuple[fx.Node, ...], outputs: list[fx.Node]
) -> fx.Graph:
    region = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = region.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in members:
        for value in node.all_input_nodes:
            if value not in env:  # a get_attr of the stage the region reads too
                env[value] = region.node_copy(value)
        env[node] = region.node_copy(node, env.__getitem__)
    region.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[node] for node in outputs))
    return region


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))
