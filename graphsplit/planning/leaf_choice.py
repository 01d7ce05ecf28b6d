"""Which leaves the planning's rounds trace into, and the leaf calls no round could.

The rounds (:mod:`graphsplit.planning.leaf_rounds`) start from every module holding
parameters as a leaf (one ``call_module`` node) and trace into a leaf when, as one call, it
would hide something the plan needs to see:

- a **mixed call worth tracing**: the leaf mixes frozen and trainable parameters (a LoRA'd
  UNet), or it is frozen and judged to mix the batch's samples while returning several values,
  and its inputs are cacheable (but for one number for the batch, the Trainer's
  ``num_items_in_batch``): traced into, the cut can separate the halves;
- a **wrapper of the step's own code**: a frozen module whose class the user wrote (not an
  installed library's) holding a module with parameters, fed cacheable values beside
  trainable ones (DeiT's ``DistillationLoss(samples, outputs, labels)`` running its teacher
  on ``samples``): traced into, its frozen call on the cacheable values alone is cacheable;
- a **call under changed state**: the step's own Python changed an attribute of the leaf or of
  a module under it before the call (Diffusion-DPO's ``unet.disable_adapters()`` before the
  reference prediction, a teacher's ``eval()`` in the step), which the tracer marks
  (``node.meta[STATE_AT_CALL]``, :mod:`graphsplit.planning.patching.module_writes`). Stage
  code calls a leaf under the state its modules hold when the stage runs, not the one the step
  gave them, so the node is not the step's call. Traced into, the leaf's own Python runs in
  the trace under the step's state, and the graph holds what that state computes (peft's
  layers skip their LoRA branch, dropout gets ``training=False``). Every leaf at the marked
  call's module or under it that is or holds a changed module is traced into at once: peft's
  flags live on every LoRA layer, levels below the UNet called. A marked call left when no
  round could trace into it is refused (:func:`refuse_changed_leaf_calls`), naming the call,
  the change and the line that made it: a split that ran the call as recorded would train on
  other numbers than the step.

In: the model; the traced graph and the trainable parameter names; the leaf names.

    initial_leaves(model) -> frozenset[str]
    calls_worth_tracing(traced, trainable, taint, model) -> (mixed, counted)
    why_traced_into(expand, changed, counted) -> str          # the report's reason
    leaves_to_trace_into(graph, leaves) -> frozenset[str]    # calls under changed state
    refuse_changed_leaf_calls(graph) -> None                  # after the rounds: TraceError
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import TaintKind, Traced
from graphsplit.errors import Fix, TraceError, user_error
from graphsplit.planning.cut.boundary import facts, module_owner
from graphsplit.planning.patching.module_writes import STATE_AT_CALL
from graphsplit.planning.rules.user_lines import is_user_code

CHANGED_STATE_FIX = Fix(
    'split with path="auto" (the default) or path="calls": the module-level path runs the '
    "step's own Python around each call; or make the change where graphsplit can trace it, "
    "as a context manager of the library (peft's `with model.disable_adapter():`)"
)


def initial_leaves(model: nn.Module) -> frozenset[str]:
    """Every submodule that holds parameters (directly or below it)."""
    return frozenset(
        name
        for name, module in model.named_modules()
        if name and next(module.parameters(), None) is not None
    )


def calls_worth_tracing(
    traced: Traced, trainable: frozenset[str], taint: Mapping[fx.Node, Any], model: nn.Module
) -> tuple[frozenset[str], frozenset[str]]:
    """``(mixed, counted)``: the leaves to trace into for what one call hides, in one pass.

    ``mixed``: leaf modules fed cacheable values that are tainted as one call but need not be
    all. A module that mixes frozen and trainable parameters; or a frozen module judged to mix
    the batch's samples that returns several values, some of which may not mix: a teacher
    called with ``labels`` returns a ``.loss`` (a mean over the batch) beside per-sample
    logits, and traced into, the unused loss is no longer part of the logits' work.

    A tainted input that is one number for the whole batch (a 0-dim tensor or a Python number:
    the Trainer's ``num_items_in_batch``, which transformers' models take through their
    ``**kwargs`` and hand on, to the loss and to their backbone's ``**kwargs``) does not keep
    a module whole: traced into, taint follows it op by op. ``counted``: frozen leaves tainted
    only by such numbers beside cacheable inputs, with every module under them but torch.nn's
    own (:func:`_library_modules_under`): the backbone that swallows the count in its
    ``**kwargs`` would otherwise be tainted by it.

    ``taint``: the graph's (:func:`~graphsplit.planning.cut.boundary.compute_taint`),
    computed once per round.
    """
    mixed_calls: set[str] = set()
    counted: set[str] = set()
    for node in traced.graph.nodes:
        owner = module_owner(node)
        if owner is None:
            continue
        inputs = [arg for arg in node.all_input_nodes if arg is not owner]
        params = facts(owner).params
        frozen = bool(params) and not params & trainable
        mixed = bool(params & trainable) and bool(params - trainable)
        why = taint.get(node)
        mixing_frozen = (
            frozen
            and why is not None
            and why.kind is TaintKind.MIXING
            and why.origin is node
            # Several outputs (a ModelOutput, a tuple), so some may not mix; one tensor that
            # mixes (a BatchNorm in train mode) mixes however finely it is traced.
            and not isinstance(node.meta.get("val"), torch.Tensor)
        )
        tainted = [arg for arg in inputs if arg in taint]
        numbers_only = all(_one_number(arg) for arg in tainted)
        if (mixed or mixing_frozen) and inputs and numbers_only:
            mixed_calls.add(owner.target)
        partly_tainted = frozen and tainted and len(tainted) < len(inputs)
        if partly_tainted and not numbers_only and _users_wrapper(model, str(owner.target)):
            mixed_calls.add(owner.target)
        if frozen and tainted and len(tainted) < len(inputs) and numbers_only:
            counted.update(_library_modules_under(model, str(owner.target)))
    return frozenset(mixed_calls), frozenset(counted)


def why_traced_into(
    expand: frozenset[str], changed: frozenset[str], counted: frozenset[str]
) -> str:
    """The report's reason for one round's expansion (:mod:`graphsplit.planning.leaf_rounds`)."""
    if expand <= changed:
        return "the step changes their state around the calls (the graph holds what each computes)"
    if expand <= counted:
        return (
            "frozen, fed one number for the batch (the Trainer's num_items_in_batch) beside "
            "cacheable inputs: traced into, it taints only what computes with it"
        )
    return (
        "its inputs are cacheable and, as one call, it mixes frozen and trainable parameters "
        "or the batch's samples; or it is the step's own module holding a frozen one, fed "
        "cacheable values beside trainable ones"
    )


def _users_wrapper(model: nn.Module, path: str) -> bool:
    """Whether the leaf at ``path`` is a module class of the user's own code holding a module
    with parameters: DeiT's ``DistillationLoss(inputs, outputs, labels)``, which runs its
    frozen teacher on the batch's ``inputs`` beside the student's ``outputs``. As one call it
    is tainted by ``outputs``; traced into, the teacher's call on ``inputs`` alone is
    cacheable. A library's frozen model fed trainable values beside cacheable ones (a frozen
    UNet given a ControlNet's residuals) stays one call: tracing into it would trace and
    analyse the whole library model again, and the module-level path covers what it hides."""
    module = model.get_submodule(path)
    source = getattr(sys.modules.get(type(module).__module__), "__file__", None)
    if source is None or not is_user_code(source):
        return False
    return any(next(child.parameters(), None) is not None for child in module.children())


def _library_modules_under(model: nn.Module, path: str) -> list[str]:
    """``path`` and every module under it but torch.nn's own (which fx calls whole): the
    number reaches every layer through their ``**kwargs``, and a round per level would run out
    of rounds in a backbone of a dozen levels."""
    found = [path]
    for name, module in model.get_submodule(path).named_modules(prefix=path):
        if name != path and not type(module).__module__.startswith("torch.nn."):
            found.append(name)
    return found


def _one_number(node: fx.Node) -> bool:
    """Whether ``node``'s value is one number for the whole batch: a 0-dim tensor or a Python
    number (its meta value, as traced)."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, (bool, int, float))


def leaves_to_trace_into(graph: fx.Graph, leaves: frozenset[str]) -> frozenset[str]:
    """Every leaf, at a marked call's module or under it, that is or holds a changed module."""
    found: set[str] = set()
    for node in graph.nodes:
        mark = node.meta.get(STATE_AT_CALL)
        if mark is None:
            continue
        for leaf in leaves:
            if _within(leaf, mark.leaf) and any(_within(c.module, leaf) for c in mark.changes):
                found.add(leaf)
    return frozenset(found)


def _within(path: str, ancestor: str) -> bool:
    """Whether the module at ``path`` is ``ancestor`` or under it."""
    return path == ancestor or path.startswith(ancestor + ".")


def refuse_changed_leaf_calls(graph: fx.Graph) -> None:
    """Refuse the first leaf call still made under a state the step changed."""
    for node in graph.nodes:
        mark = node.meta.get(STATE_AT_CALL)
        if mark is None:
            continue
        changes = mark.changes
        listed = "; ".join(str(change) for change in changes[:3])
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        raise user_error(
            TraceError,
            f"The step changes the state of {mark.leaf} before this call ({listed}"
            f"{more}), and graphsplit could not trace into it: the graph calls it as one "
            "node, which stage code would run under the state the module has then, not the "
            "one the step gave it.",
            node=node,
            fix=CHANGED_STATE_FIX,
        )
