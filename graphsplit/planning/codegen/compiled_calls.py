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

In: a stage's graph and the model. Out: the graph, its compiled leaves' calls retargeted:

    call_compiled_modules(graph, model)
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from graphsplit.planning.patching.compiled_code import ORIGINAL, original_module

__all__ = ["call_compiled_modules"]

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
