"""Grad mode and autocast switched inside the traced step: accepted where exact, else refused.

torch.fx records ops, not context managers: a ``with torch.no_grad():`` or ``with
torch.autocast(...):`` in the step's own code (its ``forward``, or any code the tracer traces
through) leaves no node, so stage code would run those ops under the caller's modes instead.
Code inside a leaf module's ``forward`` is not affected: stage code calls that ``forward``.

Glossary:
    modes: torch's thread-local switches an op's result depends on: grad mode, inference mode,
        and autocast (on or off, and its dtype) per device type (:class:`Modes`).
    ambient modes: the modes when tracing began, i.e. the caller's (a ``torch.autocast`` or
        ``torch.no_grad`` around ``graphsplit.split`` and the stage calls). Stage code runs
        under whatever the caller has, so these stay supported.
    switched node: an op node created under modes other than the ambient ones; it carries
        ``node.meta["modes"]`` = :class:`Switched` (nodes under the ambient modes carry none).
    trainable-dependent: the node reads a trainable parameter, or depends on a node that does.

Where it is exact to drop the switch, and so accepted:
    - grad mode (``no_grad``, ``set_grad_enabled``, ``inference_mode``, ``enable_grad``) around
      work that depends on no trainable parameter: no gradient flows there in either run;
    - nodes whose value is metadata (a shape, device, dtype, Python number): no gradient.
Refused: any switched autocast (its ops would change dtype), a switched grad mode around
trainable-dependent work (the stages would compute gradients that eager does not, or not
compute those it does), and ``torch.inference_mode()`` entered in traced code (its tensors
cannot be used by autograd later in the step, in eager either).

In: the tracer while it creates nodes; after the analysis, the graph and the trainable names.

    current_modes() -> Modes
    check_autocast(graph)                  # trace.py, once the step is traced
    check_grad_modes(graph, trainable, defer_mixed_calls=...)   # leaf_rounds.py, per trace
    deferred_calls_to_trace_into(graph, trainable, leaves, parameters)   # leaf_rounds.py
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from graphsplit.errors import Fix, TraceError, user_error

MODES = "modes"  # node.meta key of a switched node
# Device types whose autocast state is compared ("mps", "xpu" and the like would be the same
# kind of switch; the step's autocast device is almost always one of these two).
_AUTOCAST_DEVICES = ("cpu", "cuda")
_OP_KINDS = frozenset({"call_function", "call_method", "call_module"})
_METADATA_TYPES = (torch.device, torch.dtype, torch.Size, bool, int, float, str, type(None))

AUTOCAST_FIX = Fix(
    "put the autocast around the whole step instead: around graphsplit.split(...), around "
    "stage1 / the cache and around the training step that calls stage2, so the stages run "
    "under it as the step did; or move it inside the forward of a module that is called as a "
    "leaf (a module holding parameters, all frozen or all trainable): code inside a leaf's "
    "forward runs as written in the stages"
)
NO_GRAD_FIX = Fix(
    "use .detach() on the result instead of torch.no_grad() (e.g. target = "
    "self.model(x).detach()): torch.fx traces detach, and it gives the gradients eager gives"
)
INFERENCE_MODE_FIX = Fix(
    "use torch.no_grad() around frozen work instead (graphsplit accepts it there), or "
    ".detach() on the result of trainable work"
)
ENABLE_GRAD_FIX = Fix(
    "call graphsplit.split, stage1 and stage2 with gradients enabled (not inside "
    "torch.no_grad() or torch.inference_mode()), as training does"
)


@dataclass(frozen=True)
class Modes:
    """The switches an op's result depends on, as torch reports them."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) where it is on

    @property
    def grad(self) -> tuple[bool, bool]:
        return self.grad_enabled, self.inference_mode


@dataclass(frozen=True)
class Switched:
    """A node created under modes other than the ambient ones."""

    ambient: Modes
    inside: Modes

    @property
    def autocast_switched(self) -> bool:
        return self.ambient.autocast != self.inside.autocast

    @property
    def grad_switched(self) -> bool:
        return self.ambient.grad != self.inside.grad


def current_modes() -> Modes:
    """The modes in force now (the dtype only counts where autocast is on)."""
    autocast = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )
    return Modes(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


def mark_switched(node: fx.Node, ambient: Modes) -> None:
    """Tag an op node created under modes other than ``ambient`` (called as it is created);
    refuse inference mode entered by the step."""
    if node.op not in _OP_KINDS:
        return
    inside = current_modes()
    if inside == ambient:
        return
    if inside.inference_mode and not ambient.inference_mode:
        # Refused at once: the meta values are inference tensors, which the rest of the trace
        # could not use (and eager cannot save them for backward either).
        raise user_error(
            TraceError,
            "The step enters torch.inference_mode() inside its traced code. torch.fx records "
            "ops, not `with` blocks, and tensors made under inference mode cannot be used by "
            "autograd later in the step.",
            node=node,
            fix=INFERENCE_MODE_FIX,
        )
    node.meta[MODES] = Switched(ambient, inside)


def check_autocast(graph: fx.Graph) -> None:
    """Refuse the first op traced under an autocast the step switched itself."""
    for node in graph.nodes:
        switched = node.meta.get(MODES)
        if switched is not None and switched.autocast_switched:
            raise user_error(
                TraceError,
                "The step switches autocast inside its traced code "
                f"({_autocast_text(switched.ambient)} around graphsplit.split, "
                f"{_autocast_text(switched.inside)} here). torch.fx records ops, not `with` "
                "blocks: the stages would run these ops without that switch, in other dtypes "
                "than eager.",
                node=node,
                fix=AUTOCAST_FIX,
            )


def check_grad_modes(
    graph: fx.Graph, trainable: frozenset[str], *, defer_mixed_calls: bool = False
) -> None:
    """Refuse the first trainable-dependent op traced under a grad mode the step switched.

    With ``defer_mixed_calls``, a switched leaf call of a module holding frozen and trainable
    parameters, fed nothing trainable-dependent, counts as frozen here (and so does the work
    on its outputs): traced into, it may use its frozen ones only (a peft model under ``with
    model.disable_adapter():``, TRL's DPO reference). The rounds trace into such calls and
    check the final graph without deferring.

    Needs ``NodeFacts.params`` (:func:`graphsplit.planning.analyse.node_facts.resolve_params`).
    """
    depends = _trainable_dependent(graph, trainable, defer_mixed_calls)
    for node in graph.nodes:
        switched = node.meta.get(MODES)
        if switched is None or not switched.grad_switched or node not in depends:
            continue
        if _is_metadata(node.meta.get("val")):
            continue  # a shape, device or number carries no gradient
        disabled = not switched.inside.grad_enabled
        unfrozen = _run_under_no_grad_only(graph, trainable, depends[node]) if disabled else None
        effect = (
            "enabled, so they would compute gradients that eager does not"
            if disabled
            else "disabled, so they would miss gradients that eager computes"
        )
        raise user_error(
            TraceError,
            f"The step {_grad_text(switched.inside)} around work that depends on trainable "
            f"parameters ({', '.join(depends[node])}). torch.fx records ops, not `with` "
            f"blocks: the stages would run this work with gradients {effect}.",
            node=node,
            fix=Fix(_freeze_words(unfrozen))
            if unfrozen
            else (NO_GRAD_FIX if disabled else ENABLE_GRAD_FIX),
        )


def _run_under_no_grad_only(graph: fx.Graph, trainable: frozenset[str], names: tuple) -> str | None:
    """The module holding ``names`` where every op reading its trainable parameters runs
    under ``no_grad`` (a teacher put in ``eval()`` but never frozen: no gradient can reach
    it), else None. ``.detach()`` would trace, but the module would still count as trained
    and nothing of it be cached: it should be frozen."""
    owners = sorted({name.rsplit(".", 1)[0] for name in names if "." in name})
    if not owners:
        return None
    held = frozenset(
        name for name in trainable if any(name.startswith(owner + ".") for owner in owners)
    )
    for node in graph.nodes:
        facts = node.meta.get("facts")
        if facts is None or not facts.params & held:
            continue
        switched = node.meta.get(MODES)
        if switched is None or switched.inside.grad_enabled:
            return None  # read with gradients somewhere: it may be trained
    return _common_owner(owners)


def _freeze_words(module: str) -> str:
    return (
        f"if {module} is not trained, freeze it before splitting "
        f"({module}.requires_grad_(False)): it is only ever run under no_grad, so no gradient "
        "reaches it, and frozen its work can be cached; if it is trained, " + NO_GRAD_FIX.words
    )


def _common_owner(owners: list[str]) -> str:
    """The deepest module path holding every one of ``owners`` (the first's top otherwise)."""
    parts = [owner.split(".") for owner in owners]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or parts[0][0]


def _trainable_dependent(
    graph: fx.Graph, trainable: frozenset[str], defer_mixed_calls: bool = False
) -> dict[fx.Node, tuple]:
    """Nodes that read a trainable parameter or depend on one, with the first such names."""
    depends: dict[fx.Node, tuple] = {}
    for node in graph.nodes:
        if defer_mixed_calls and _switched_mixed_call_fed_frozen(node, trainable, depends):
            continue
        facts = node.meta.get("facts")
        read = tuple(sorted(facts.params & trainable)) if facts is not None else ()
        if read:
            depends[node] = read[:3]
            continue
        producer = next((arg for arg in node.all_input_nodes if arg in depends), None)
        if producer is not None:
            depends[node] = depends[producer]
    return depends


def deferred_calls_to_trace_into(
    graph: fx.Graph, trainable: frozenset[str], leaves: frozenset[str], parameters: Iterable[str]
) -> frozenset[str]:
    """The leaves to trace into for the calls ``defer_mixed_calls`` let through: each such
    call's module and every leaf under it holding frozen and trainable ``parameters`` (all
    names), at once: a round per level would run out of rounds on a model of a few layers."""
    depends: dict[fx.Node, tuple] = {}
    targets = [
        node.target
        for node in graph.nodes
        if node.op == "call_module" and _switched_mixed_call_fed_frozen(node, trainable, depends)
    ]
    names = tuple(parameters)

    def mixed(leaf: str) -> bool:
        held = {name for name in names if name.startswith(leaf + ".")}
        return bool(held & trainable) and bool(held - trainable)

    return frozenset(
        leaf
        for leaf in leaves
        if any(leaf == target or leaf.startswith(f"{target}.") for target in targets)
        and mixed(leaf)
    )


def _switched_mixed_call_fed_frozen(
    node: fx.Node, trainable: frozenset[str], depends: dict[fx.Node, tuple]
) -> bool:
    """A leaf module call under a switched grad mode, holding frozen and trainable parameters,
    fed nothing trainable-dependent."""
    facts, switched = node.meta.get("facts"), node.meta.get(MODES)
    if node.op != "call_module" or facts is None or switched is None:
        return False
    if not switched.grad_switched:
        return False
    mixed = bool(facts.params & trainable) and bool(facts.params - trainable)
    return mixed and not any(arg in depends for arg in node.all_input_nodes)


def _is_metadata(value: object) -> bool:
    if isinstance(value, _METADATA_TYPES):
        return True
    return isinstance(value, tuple) and all(isinstance(item, _METADATA_TYPES) for item in value)


def _autocast_text(modes: Modes) -> str:
    on = [f"{device}: {str(dtype).removeprefix('torch.')}" for device, dtype in modes.autocast]
    return f"autocast on ({', '.join(on)})" if on else "autocast off"


def _grad_text(modes: Modes) -> str:
    if not modes.grad_enabled:
        return "disables gradients (torch.no_grad() or torch.set_grad_enabled(False))"
    return "enables gradients (torch.enable_grad()) under the caller's torch.no_grad()"
