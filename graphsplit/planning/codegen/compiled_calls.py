"""Stage code calls the user's ``torch.compile``'d module where the step called it whole.

The planning runs a compiled module as its original (``unet._orig_mod``, see
:mod:`graphsplit.planning.patching.compiled_code`), so a leaf call of it is a
``call_module`` node targeting ``unet._orig_mod``. Generated code that called that path would
run the module uncompiled; this pass points such a node back at the compiled wrapper
(``unet``), the object the step itself calls. Both hold the same parameters under the same
names (``unet._orig_mod.*``), so the stage's state dict is unchanged by the pass.

A compiled module the trace went into (a LoRA UNet whose frozen half is cached) has no such
node: its code is in the stage as operations and runs uncompiled there; compile the stage
(``split.stage2 = torch.compile(split.stage2)``) to compile it again.

In: a stage's graph and the model. Out: the graph, its compiled leaves' calls retargeted;
the notes naming the compiled modules whose code a stage runs as operations:

    call_compiled_modules(graph, model)
    compiled_code_notes(stage, model) -> list[str]
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from graphsplit.planning.patching.compiled_code import ORIGINAL, original_module

__all__ = ["call_compiled_modules", "compiled_code_notes"]

_ORIGINAL = f".{ORIGINAL}"


def call_compiled_modules(graph: fx.Graph, model: nn.Module) -> None:
    """Retarget every ``call_module`` of a compiled module's original to the compiled module."""
    for node in graph.nodes:
        if node.op != "call_module" or not node.target.endswith(_ORIGINAL):
            continue
        wrapper_path = node.target[: -len(_ORIGINAL)]
        wrapper = model.get_submodule(wrapper_path)
        if original_module(wrapper) is model.get_submodule(node.target):
            node.target = wrapper_path


def compiled_code_notes(stage: fx.GraphModule, model: nn.Module) -> list[str]:
    """One note per compiled module (``torch.compile(m)`` or ``m.compile()``) whose code
    ``stage`` runs as operations, uncompiled, rather than as one call of the compiled object."""
    called = {node.target for node in stage.graph.nodes if node.op == "call_module"}
    used = {node.target for node in stage.graph.nodes if node.op in ("call_module", "get_attr")}
    notes = []
    for path, module in model.named_modules():
        if original_module(module) is not None:
            inside = f"{path}{_ORIGINAL}."
        elif vars(module).get("_compiled_call_impl") is not None:
            inside = f"{path}."
        else:
            continue
        if path and path not in called and any(t.startswith(inside) for t in used):
            notes.append(
                f"stage 2 runs the code of the torch.compile'd {path} uncompiled: the trace went "
                "into it to cache its frozen part; to compile it again, compile stage 2 "
                "(stage2 = torch.compile(split.stage2))"
            )
    return notes
