"""Keep activation checkpointing: each ``checkpoint(fn, ...)`` traced through is one in stage 2.

The tracer runs ``torch.utils.checkpoint.checkpoint(fn, *args)`` by tracing ``fn(*args)``
(the graph holds what ``fn`` computes, not the checkpoint), and tags every node it creates
meanwhile with the call's :class:`CheckpointRegion` (``node.meta["checkpoint"]``, see
:func:`graphsplit.planning.patching.checkpoint_regions.record_checkpoints`). Without this pass,
stage 2 would run those nodes plainly: same numbers, but every activation of every DiT block
kept for backward.

Glossary:
    checkpoint region: the nodes one ``checkpoint`` call traced, and the options it was called
        with (``use_reentrant``, ``preserve_rng_state``, ``determinism_check``, ``context_fn``,
        ...), passed on unchanged.
    stage-2 part: the region's nodes stage 2 runs. Work stage 1 caches (a frozen prefix of
        ``fn``) is not in it; a region with no stage-2 part is not checkpointed at all.
    module region: a stage-2 part that is exactly one call of a module, which is how DiffSynth
        (``checkpoint(create_custom_forward(block), x, ..., use_reentrant=False)``) and
        diffusers (``checkpoint(block.__call__, ...)``) write it. Stage 2 then reads
        ``checkpoint(self.blocks[0], x, ..., use_reentrant=False)``: the block's own forward,
        hooks and LoRA layers, recomputed in backward as the step did it.
    outlined region: any other stage-2 part (several modules and ops in one ``fn``, a
        transformers layer traced into, the trainable remainder of a partly cached region):
        moved into a region module (:mod:`graphsplit.planning.rules.outline`) held by the stage as
        ``checkpointed_<n>`` and called as ``checkpoint(self.checkpointed_0, *inputs, ...)``;
        its inputs are the values it reads from outside, its outputs the values used after it.
    held option: an option that is not a literal (``context_fn``, a callable) is an attribute
        of the stage (``checkpointed_0_context_fn``) the call reads, never written into code.
    reentrant call: ``use_reentrant=True`` regions call :func:`reentrant_checkpoint`, which is
        torch's ``checkpoint`` once an input requires grad. Torch's reentrant engine passes
        gradients to the parameters inside only when one does; in the step it does
        (transformers' ``gradient_checkpointing_enable`` hooks the input embeddings to make
        their output require grad), but a cached boundary tensor loaded from disk never does.

In: the stage-2 GraphModule just built, its nodes still tagged. Out: the same module, each
region's stage-2 part one ``checkpoint`` call, recompiled:

    recheckpoint(stage) -> None
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint

from graphsplit.errors import SplitError, user_error
from graphsplit.planning.rules.outline import SAVE_STAGE2_FIX, Wrap, outline

# Where the tracer tags the nodes traced inside a checkpoint() call.
CHECKPOINT = "checkpoint"
# The real function (the tracer replaces the module attribute while it runs).
_CHECKPOINT = torch.utils.checkpoint.checkpoint
# Option values generated code may spell as literals; any other value is held by the stage.
_LITERALS = (bool, int, float, str, type(None))


@dataclass(frozen=True, eq=False)
class CheckpointRegion:
    """One traced ``checkpoint()`` call: its index in the step and its keyword options."""

    index: int
    options: dict[str, Any] = field(default_factory=dict)


def reentrant_checkpoint(function: Any, *args: Any, **options: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, **options)`` with an input that
    requires grad, as the reentrant engine needs to pass gradients to the parameters inside.

    When no tensor argument requires grad (all came from the cache), the first floating-point
    one is passed as a leaf that does, ``detach().requires_grad_()``: what the step's own
    input-embedding hook did to the value it computed; its gradient is computed and dropped.
    """
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if torch.is_grad_enabled() and not any(tensor.requires_grad for tensor in tensors):
        first = next((tensor for tensor in tensors if tensor.is_floating_point()), None)
        if first is not None:
            args = tuple(arg.detach().requires_grad_() if arg is first else arg for arg in args)
    return torch.utils.checkpoint.checkpoint(function, *args, **options)


def recheckpoint(stage: fx.GraphModule) -> None:
    """Make each region's stage-2 part one ``checkpoint`` call (module or outlined form)."""
    regions: dict[CheckpointRegion, list[fx.Node]] = {}
    for node in stage.graph.nodes:
        region = node.meta.get(CHECKPOINT)
        if region is not None and node.op not in ("placeholder", "output"):
            regions.setdefault(region, []).append(node)
    rewritten = False
    for number, (region, members) in enumerate(_worth_checkpointing(regions)):
        name = _free_name(stage, f"checkpointed_{number}")
        options = _option_arguments(stage, region.options, name, before=members[0])
        call = _module_call(members, region)
        if call is not None:
            _checkpoint_module_call(stage.graph, call, options)
            refuse_pickling(stage)
        else:
            outline(stage, members, name, _checkpoint_call(options))
        rewritten = True
    stage.graph.lint()
    if rewritten:  # else GraphModule compiled this very graph already (6% of a 10k chain)
        stage.recompile()


def refuse_pickling(stage: fx.GraphModule) -> None:
    """Make pickling ``stage`` (and its deep copies) a ``SplitError`` naming the fix.

    fx pickles a GraphModule as its code and traces that code again when loading; that trace
    runs through ``checkpoint(self.blocks_0, ...)``, so the loaded stage would train without
    checkpointing, silently. fx gives each GraphModule a class of its own, so the refusal is
    installed on that class only; a deep copy (an EMA copy) gets a new class, and the refusal
    again.
    """
    cls = type(stage)
    if cls.__dict__.get("__reduce__") is _refused_reduce:
        return
    cls.__reduce__ = _refused_reduce
    cls.__deepcopy__ = _deepcopy_refusing_pickling


def _refused_reduce(self: fx.GraphModule) -> Any:
    raise user_error(
        SplitError,
        "Stage 2 cannot be pickled: it checkpoints module calls (checkpoint(self.block, ...)), "
        "and fx rebuilds a pickled stage by tracing its code again, which would run the "
        "blocks without checkpointing.",
        fix=SAVE_STAGE2_FIX,
    )


def _deepcopy_refusing_pickling(self: fx.GraphModule, memo: dict[int, Any]) -> fx.GraphModule:
    copied = fx.GraphModule.__deepcopy__(self, memo)
    refuse_pickling(copied)
    return copied


def _free_name(stage: fx.GraphModule, name: str) -> str:
    """``name``, or ``name_1``, ... if the model already has an attribute of that name."""
    candidate, index = name, 0
    while hasattr(stage, candidate):
        index += 1
        candidate = f"{name}_{index}"
    return candidate


def _worth_checkpointing(
    regions: dict[CheckpointRegion, list[fx.Node]],
) -> list[tuple[CheckpointRegion, list[fx.Node]]]:
    """Regions whose stage-2 part computes something the step reads afterwards."""
    found = []
    for region, members in regions.items():
        inside = set(members)
        computes = any(node.op != "get_attr" for node in members)
        used = any(user not in inside for node in members for user in node.users)
        if computes and used:
            found.append((region, members))
    return found


def _module_call(members: list[fx.Node], region: CheckpointRegion) -> fx.Node | None:
    """The region's one module call, if its stage-2 part is that call and nothing else."""
    calls = [node for node in members if node.op != "get_attr"]
    if len(calls) != 1 or calls[0].op != "call_module":
        return None
    if calls[0].kwargs and region.options.get("use_reentrant", True):
        return None  # the reentrant engine takes positional arguments only: outlined instead
    return calls[0]


def _option_arguments(
    stage: fx.GraphModule, options: dict[str, Any], name: str, *, before: fx.Node
) -> dict[str, Any]:
    """The call's keyword arguments: literals as written, other values read from the stage."""
    arguments: dict[str, Any] = {}
    for option, value in options.items():
        if option == "context_fn" and value is torch.utils.checkpoint.noop_context_fn:
            continue  # the default, spelled out by the step
        if isinstance(value, _LITERALS):
            arguments[option] = value
            continue
        attribute = f"{name}_{option}"
        setattr(stage, attribute, value)
        with stage.graph.inserting_before(before):
            # create_node: get_attr() warns about an attribute that is not a tensor or module
            arguments[option] = stage.graph.create_node("get_attr", attribute)
        arguments[option].meta = {"val": None}
    return arguments


def _checkpoint_module_call(graph: fx.Graph, call: fx.Node, options: dict[str, Any]) -> None:
    """``self.block(*args, **kwargs)`` -> ``checkpoint(self.block, *args, **kwargs, **opts)``."""
    with graph.inserting_before(call):
        module = graph.create_node("get_attr", call.target, name=f"{call.name}_module")
        module.meta = {"val": None, "source": call.meta.get("source")}
        replacement = graph.create_node(
            "call_function",
            _engine(options),
            (module, *call.args),
            {**call.kwargs, **options},
            name=f"{call.name}_checkpointed",
        )
    replacement.meta = dict(call.meta)
    call.replace_all_uses_with(replacement)
    graph.erase_node(call)


def _checkpoint_call(options: dict[str, Any]) -> Wrap:
    """How an outlined region is called: ``checkpoint(region, *inputs, **options)``."""

    def wrap(graph: fx.Graph, region: fx.Node, inputs: tuple[fx.Node, ...]) -> fx.Node:
        return graph.call_function(_engine(options), (region, *inputs), dict(options))

    return wrap


def _engine(options: dict[str, Any]) -> Any:
    """Torch's ``checkpoint``, or :func:`reentrant_checkpoint` for the reentrant engine."""
    return reentrant_checkpoint if options.get("use_reentrant", True) else _CHECKPOINT
