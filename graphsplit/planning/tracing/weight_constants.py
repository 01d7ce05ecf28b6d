"""Refuse a tensor the step computed from the model's weights where the trace could not see it.

The trace sees a weight when the step reads it as a module attribute (``self.lora_A.weight``):
that read is a ``get_attr`` node, and stage code reads the live weight every step. A weight
reached another way (a loop over ``model.named_parameters()`` or ``parameters()``) is the
tensor itself, a ``meta`` twin under the analysis view, and whatever the step computes from it
happens eagerly while tracing; fx then stores the result as a tensor constant of the graph.
peft's ``AdaLoraModel.forward`` adds its orthogonal regularisation this way
(``for n, p in self.model.named_parameters(): ... p @ p.T``).

The same constant comes from a tensor made before the step and moved to a module's device
(``ids.to(text_encoder.device)``, diffusers' ``encode_prompt`` on pretokenized ids: the device
is ``meta`` while planning), and from a value a forward hook stored inside a module call
(a FitNets hint dict); the message names all three.

Such a constant is wrong twice: it is a value of the weights at planning time (trainable
weights move every step, and the constant would carry no gradient to them), and it is a
``meta`` tensor that no stage can run with. Without this check stage 2 failed only when run,
with a message about loading real weights. The step is refused here, naming the line where the
constant enters traced code; the ``auto`` path then tries the module-level path, which runs the
step's own Python in stage 2 and so computes the term live.

    refuse_weight_constants(graph, constants, trainable_ids) -> None   # or raises TraceError
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphsplit.errors import Fix, TraceError, user_error

__all__ = ["refuse_weight_constants"]


def refuse_weight_constants(graph: fx.Graph, constants: dict[str, Any]) -> None:
    """Raise ``TraceError`` if a traced constant that some node reads was computed from weights.

    Under the analysis view every weight is ``meta``: a ``meta`` constant can only have been
    computed from one (tensors of helper objects keep their real values in ``constants``). A
    constant only dead code reads (a metric the loss never uses) runs in neither stage: left.
    """
    live = _live_nodes(graph)
    for node in graph.nodes:
        if node.op != "get_attr" or node not in live:
            continue
        value = constants.get(node.target)
        if not isinstance(value, torch.Tensor) or value.device.type != "meta":
            continue
        user = next(iter(node.users))
        trained = (
            " It depends on trainable parameters: stage 2 would train nothing through it."
            if value.requires_grad
            else ""
        )
        raise user_error(
            TraceError,
            "The step computes a tensor from the model's weights where the trace cannot see "
            "them, so the value would be frozen into the plan as a constant, computed once "
            "while graphsplit planned with every weight on the meta device. Three ways in: "
            "weights reached by a loop over named_parameters() or parameters() (not read as "
            "module attributes); a tensor made before the step moved to a module's device "
            "(ids.to(text_encoder.device): that device is meta while graphsplit plans); a "
            "value a forward hook stored inside a module call and the step reads after it."
            f"{trained}",
            node=user,
            fix=WEIGHT_CONSTANT_FIX,
        )


WEIGHT_CONSTANT_FIX = Fix(
    "read each weight as a module attribute in the step (self.layer.weight); move tensors to "
    "a batch tensor's device (ids.to(pixel_values.device)) instead of a module's; return the "
    "feature from the module instead of keeping it from a hook; or split with "
    'path="calls", whose stage 2 runs that code live (path="auto" tries it after this '
    "refusal); for peft's AdaLoRA regulariser, AdaLoraConfig(orth_reg_weight=0.0) drops the term"
)


def _live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes the graph's output depends on."""
    live: set[fx.Node] = set()
    pending = [node for node in graph.nodes if node.op == "output"]
    while pending:
        node = pending.pop()
        if node not in live:
            live.add(node)
            pending.extend(node.all_input_nodes)
    return live
