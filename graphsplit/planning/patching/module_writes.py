"""Writes the step's own Python makes into its modules while traced, and which leaf calls see them.

A module called as one node of the graph (a leaf) runs its ``forward`` when stage code calls
it, under whatever state the module holds then. The step's Python around the call is not in the
graph: diffusers' Diffusion-DPO script gets its reference prediction with
``unet.disable_adapters()``, the same ``unet(...)`` call as the policy's, then
``unet.enable_adapters()``; a teacher's ``teacher.eval()`` at the top of the step. The graph
would hold two identical ``unet`` calls (stage 2 would run the reference with the LoRA on), or
one teacher call run in whatever mode the teacher is in when stage 1 runs. So while the step is
traced, every write into a module's attributes by code that is not a node's meta run
(:class:`ModuleWrites`) is followed, and each leaf call made while some attribute of a module
under it holds another value than it held when the trace began is marked
(``node.meta[STATE_AT_CALL]``, :mod:`graphsplit.planning.leaf_choice` says what the planning
does with it). A value written back (``enable_adapters()``) is no longer a change: the policy's
call is not marked.

Glossary:
    write: ``module.name = value`` through ``nn.Module.__setattr__`` (``train()`` / ``eval()``,
        peft's ``enable_adapters`` / ``set_adapter``, a user's flag), made in the tracing
        thread by code other than the tracers' own (graphsplit's patches set leaf methods on
        modules, torch.fx stores tensor constants on the root).
    changed attribute: a written attribute whose value is not its value when the trace began
        (``is`` the same object, or an equal plain value: a bool, number, string, ``None``, or
        a list / tuple / set / dict of them). ``teacher.eval()`` on a teacher already in eval
        mode changes nothing; nor does an attribute of one of torch.nn's own modules that its
        ``forward`` (and the methods it names) never loads: ``eval()`` sets ``training`` on
        every ``Linear``, which only dropout's, batch norm's and the like read.

Cost: nothing for a leaf call while no attribute is changed (the usual step); otherwise one
walk of the model's module paths per trace, then a prefix test per changed attribute.

In: the patcher and tracer of one trace, the step's root module. Out: the recorder, which the
tracer asks at each leaf call:

    STATE_AT_CALL, ChangedState, StateChange    # the mark: node.meta[STATE_AT_CALL]
    record_module_writes(patcher, tracer, root) -> ModuleWrites
    writes.mark(node, module_handles) -> None   # at each node the tracer creates
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_builtins import called_by_the_tracer
from graphsplit.planning.rules.user_lines import current_line

STATE_AT_CALL = "state_at_call"  # node.meta key of a leaf call made under changed state


@dataclass(frozen=True)
class StateChange:
    """An attribute of a module under a leaf that the step changed before calling the leaf."""

    module: str  # the module's path in the model ("" for the model itself)
    attribute: str
    line: str  # the user's line that wrote it

    def __str__(self) -> str:
        where = f"{self.module}.{self.attribute}" if self.module else self.attribute
        return f"{where} (set at {self.line})"


@dataclass(frozen=True)
class ChangedState:
    """The mark of a leaf call made under changed state: the leaf it calls, and the changes."""

    leaf: str
    changes: tuple[StateChange, ...]


_MISSING = object()
_PLAIN = frozenset({bool, int, float, str, type(None)})


def _same(before: Any, after: Any) -> bool:
    """Whether ``after`` is the value ``before`` was: the same object, or an equal plain value."""
    if before is after:
        return True
    if type(before) is not type(after):
        return False
    if type(before) in _PLAIN:
        return before == after
    if isinstance(before, (list, tuple, set, frozenset)):
        items = (*before, *after)
        return all(type(item) in _PLAIN for item in items) and before == after
    if isinstance(before, dict):
        items = (*before.keys(), *before.values(), *after.keys(), *after.values())
        return all(type(item) in _PLAIN for item in items) and before == after
    return False


def _unread_by_torch_forward(module: nn.Module, name: str) -> bool:
    """Whether ``module`` is one of torch's own (``torch.nn``, which fx never traces into) and
    its ``forward`` cannot read ``name``: ``eval()`` sets ``training`` on every ``Linear``, which
    only dropout's, batch norm's and the like read."""
    kind = type(module)
    if not kind.__module__.startswith(("torch.nn.", "torch.ao.nn.")):
        return False
    names = _TORCH_FORWARD_READS.get(kind)
    if names is None:
        names = _TORCH_FORWARD_READS[kind] = _names_read(kind, "forward", set())
    return name not in names


_TORCH_FORWARD_READS: dict[type, frozenset[str]] = {}


def _names_read(kind: type, method: str, seen: set[str]) -> frozenset[str]:
    """The attribute and global names ``kind.method``'s code (and its nested code) loads,
    with those of the methods of ``kind`` it names, recursively (``Conv2d.forward`` calls
    ``self._conv_forward``)."""
    seen.add(method)
    function = getattr(kind, method, None)
    pending = [getattr(function, "__code__", None)]
    names: set[str] = set()
    while pending:
        code = pending.pop()
        if code is None:
            continue
        names.update(code.co_names)
        pending.extend(const for const in code.co_consts if hasattr(const, "co_names"))
    for name in list(names):
        if name not in seen and callable(getattr(kind, name, None)):
            names |= _names_read(kind, name, seen)
    return frozenset(names)


def _current(module: nn.Module, name: str) -> Any:
    """``module.name`` where ``nn.Module.__setattr__`` keeps it (a parameter, a buffer, a
    submodule or a plain attribute), or a marker when it has none."""
    for table in ("_parameters", "_buffers", "_modules"):
        held = module.__dict__.get(table)
        if held is not None and name in held:
            return held[name]
    return module.__dict__.get(name, _MISSING)


class ModuleWrites:
    """The changed attributes of the step's modules while one trace runs (see the glossary)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        # (id(module), name) -> (module, the value when the trace began, the line that wrote)
        self.changed: dict[tuple[int, str], tuple[nn.Module, Any, str]] = {}
        self._originals: dict[tuple[int, str], tuple[nn.Module, Any]] = {}
        self._paths: dict[int, str] | None = None

    def before_write(self, module: nn.Module, name: str) -> None:
        """Remember what ``module.name`` held before its first write in this trace."""
        key = (id(module), name)
        if key not in self._originals:
            self._originals[key] = (module, _current(module, name))

    def after_write(self, module: nn.Module, name: str) -> None:
        """Mark ``module.name`` changed, or no longer changed when it holds its value again."""
        key = (id(module), name)
        _, original = self._originals[key]
        if _same(original, _current(module, name)):
            self.changed.pop(key, None)
        elif key not in self.changed:
            self.changed[key] = (module, original, current_line())

    def mark(self, node: fx.Node, module_handles: Mapping[str, Any]) -> None:
        """Mark ``node`` (just created) with the changes under the leaf it calls, if any: a
        ``call_module`` node, or a leaf method's ``call_method`` node on the module's handle
        (one of ``module_handles``, the tracer's ``get_attr`` proxies by leaf name)."""
        if not self.changed:
            return
        if node.op == "call_module":
            leaf = str(node.target)
        elif node.op == "call_method" and node.args and isinstance(node.args[0], fx.Node):
            leaf = str(node.args[0].target)
            if node.args[0].op != "get_attr" or leaf not in module_handles:
                return
        else:
            return
        changes = self.changes_under(leaf)
        if changes:
            node.meta[STATE_AT_CALL] = ChangedState(leaf, changes)

    def changes_under(self, path: str) -> tuple[StateChange, ...]:
        """The changed attributes of the module at ``path`` (in the root) and its submodules."""
        if not self.changed:
            return ()
        paths = self._module_paths()
        found = []
        for (module_id, name), (module, _, line) in self.changed.items():
            where = paths.get(module_id)
            if where is None or not (where == path or where.startswith(path + ".")):
                continue
            if not _unread_by_torch_forward(module, name):
                found.append(StateChange(where, name, line))
        return tuple(found)

    def _module_paths(self) -> dict[int, str]:
        if self._paths is None:
            self._paths = {id(module): name for name, module in self.root.named_modules()}
        return self._paths


def record_module_writes(patcher: Patcher, tracer: Any, root: nn.Module) -> ModuleWrites:
    """Follow writes into modules (``nn.Module.__setattr__``) while ``patcher`` is active.

    ``tracer.computing_meta`` is true while a node's meta value is computed: a leaf's own
    ``forward`` writing its caches then is the leaf's business, not the step's.
    """
    writes = ModuleWrites(root)
    original = nn.Module.__setattr__

    def recording_setattr(module: nn.Module, name: str, value: Any) -> None:
        if (
            tracer.computing_meta
            or not patcher.traces_here()
            # The tracers' own writes: graphsplit's patches set leaf methods, torch.fx stores
            # the tensor constants it meets on the root (``_tensor_constant0``).
            or called_by_the_tracer()
        ):
            original(module, name, value)
            return
        writes.before_write(module, name)
        original(module, name, value)
        writes.after_write(module, name)

    patcher.patch_method(nn.Module, "__setattr__", recording_setattr)
    return writes
