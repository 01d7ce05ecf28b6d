"""Run one traced node on ``meta`` tensors: the torch.fx Interpreter both of the planning's
interpreters build on.

Glossary:
    meta run: one node's ops executed on fake ``meta`` tensors inside
        :func:`~graphsplit.planning.meta.analysis_view.meta_execution` (and the eager protocols
        on meta), so shapes, dtypes and FLOPs come out without real weights or data. A failing
        op raises a :class:`~graphsplit.errors.TraceError` naming the node
        (:func:`~graphsplit.planning.meta.meta_failures.meta_failure`).
    memo head: what a node runs, for the call memo's key (a torch function, a tensor method's
        name, a module's class); a node without one (a user's function) always runs.

In: a model, a graph, its input values by placeholder name, the traced constants. Out: the
base class of :class:`~graphsplit.planning.meta.tracing_interpreter.TracingInterpreter` and
:class:`~graphsplit.planning.meta.probe_interpreter.ProbeInterpreter`:

    MetaInterpreter(model, graph, inputs, constants).run_on_meta(node, record=...)
        -> (value, OpRecord or None)
    fetch(model, constants, target) -> Any        # what a get_attr / call_module target names
    is_meta_run(code) -> bool                     # whether a frame runs one node on meta
    meta_contexts() -> ContextManager             # what a node's meta run is entered in
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._C import (
    _get_function_stack_at,
    _len_torch_function_stack,
    _pop_torch_function_stack,
    _push_on_torch_function_stack,
)
from torch.fx.immutable_collections import immutable_dict, immutable_list

from graphsplit.artifacts import OpRecord
from graphsplit.errors import GraphsplitError
from graphsplit.planning.meta import call_memo
from graphsplit.planning.meta.analysis_view import current_call_memo, meta_execution, to_meta
from graphsplit.planning.meta.eager_protocols import eager_protocols_on_meta
from graphsplit.planning.meta.meta_failures import ArgumentWritten, meta_failure
from graphsplit.planning.meta.op_recorder import recorded
from graphsplit.planning.patching.torch_calls import TracedTorchCalls


def fetch(model: nn.Module, constants: Mapping[str, Any], target: str) -> Any:
    """The object a ``get_attr`` / ``call_module`` target names."""
    if target in constants:
        return constants[target]
    value: Any = model
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


class MetaInterpreter(fx.Interpreter):
    """Runs nodes on meta; ``get_attr`` values are meta twins, placeholders come by name."""

    def __init__(
        self,
        model: nn.Module,
        graph: fx.Graph,
        inputs: Mapping[str, Any],
        constants: Mapping[str, Any],
    ) -> None:
        # fx.Interpreter.__init__ tabulates every submodule (``self.submodules``), a walk of
        # the whole model (SDXL: 7,922 modules) per interpreter that no meta run reads: it is
        # given an empty module, and the table is built on demand (the property below).
        super().__init__(_NO_SUBMODULES, garbage_collect_values=False, graph=graph)
        self.module = model
        self.extra_traceback = False  # our errors already name the node and the user's line
        self.model = model
        self.inputs = inputs
        self.constants = constants
        # The meta contexts while they are held across nodes (see ProbeInterpreter.run_node).
        self.on_meta: contextlib.ExitStack | None = None

    @property
    def submodules(self) -> dict[str, nn.Module]:
        """fx's ``{qualified name: module}`` table, built when something asks for it."""
        return dict(self.module.named_modules())

    @submodules.setter
    def submodules(self, table: dict[str, nn.Module]) -> None:
        pass  # fx.Interpreter.__init__ sets the empty module's; the property answers instead

    def placeholder(self, target, args, kwargs) -> Any:
        return self.inputs.get(target)

    def get_attr(self, target, args, kwargs) -> Any:
        return to_meta(fetch(self.model, self.constants, target))

    def call_module(self, target, args, kwargs) -> Any:
        module = self.model.get_submodule(target)
        containers = [
            value for value in (*args, *kwargs.values()) if isinstance(value, _FX_CONTAINERS)
        ]
        if not containers:
            return module(*args, **kwargs)
        # fx hands a dict or list argument over as its immutable copy, and a module that
        # writes into it (as eager code may: the step built the dict for it) fails inside
        # fx; it gets a plain copy, and a write into it is refused by its own error.
        plain = {id(value): _plain(value) for value in containers}
        args = tuple(plain.get(id(value), value) for value in args)
        kwargs = {key: plain.get(id(value), value) for key, value in kwargs.items()}
        before = {key: _items(value) for key, value in plain.items()}
        result = module(*args, **kwargs)
        for key, value in plain.items():
            if _written(before[key], _items(value)):
                kind = "dict" if isinstance(value, dict) else "list"
                raise ArgumentWritten(target, kind)
        return result

    def _run_node_plainly(self, node: fx.Node) -> Any:
        """``fx.Interpreter.run_node`` without what it does for other tools: it enters two
        generator contexts per node (``set_current_meta``, which only acts while fx preserves
        node meta for torch.export) and formats a debug log line; both are kept when on."""
        if fx_traceback.has_preserved_node_meta() or _FX_LOG.isEnabledFor(logging.DEBUG):
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        return getattr(self, node.op)(node.target, args, kwargs)

    def _run_and_record(self, node: fx.Node, *, record: bool) -> tuple[Any, OpRecord | None]:
        if record:
            return recorded(lambda: self._run_node_plainly(node))
        return self._run_node_plainly(node), None

    def run_on_meta(self, node: fx.Node, *, record: bool) -> tuple[Any, OpRecord | None]:
        """Run one node on meta (recording its ops if asked); a failure becomes a TraceError,
        a TensorValueError where the failure's type says it read a value (:func:`meta_failure`).

        A node that repeats an earlier pure one (same function or module state, same
        argument metadata) is answered by the analysis's call memo
        (:func:`call_memo.replay_or_run_node`).
        """
        try:
            head, module = self._memo_head(node)
            memo = current_call_memo() if head is not None else None
            if memo is None:
                return self._run_in_meta_contexts(node, record=record)
            return call_memo.replay_or_run_node(
                memo,
                head,
                module,
                record,
                lambda: self._run_in_meta_contexts(node, record=record),
                self.fetch_args_kwargs_from_env(node),
            )
        except GraphsplitError:
            raise
        except Exception as exc:
            raise meta_failure(node, exc) from exc

    def _run_in_meta_contexts(self, node: fx.Node, *, record: bool) -> tuple[Any, OpRecord | None]:
        if self.on_meta is not None:  # a probe holds the contexts (see ProbeInterpreter)
            return self._run_and_record(node, record=record)
        with _TracerModesSetAside(), meta_execution(), eager_protocols_on_meta():
            return self._run_and_record(node, record=record)

    def _memo_head(self, node: fx.Node) -> tuple[Any, nn.Module | None]:
        """What the node runs, for the memo's key: ``(head, module)``; head None: no memo.

        Only calls whose Python side is torch's or ``operator``'s (their effects are ops the
        memo watches), tensor methods and module calls (whose state is keyed) qualify; any
        other function (a user's, graphsplit's own) always runs.
        """
        if node.op == "call_module":
            module = self.model.get_submodule(node.target)
            return ("call_module", type(module)), module
        if node.op == "call_function" and _torch_or_operator(node.target):
            return ("call_function", node.target), None
        if node.op == "call_method":
            return ("call_method", node.target), None
        return None, None


_FX_CONTAINERS = (immutable_dict, immutable_list)


def _plain(value: immutable_dict | immutable_list) -> dict | list:
    return dict(value) if isinstance(value, dict) else list(value)


def _items(value: dict | list) -> list[tuple[Any, Any]]:
    """What a container holds (the items themselves, kept alive for the comparison)."""
    return list(value.items() if isinstance(value, dict) else enumerate(value))


def _written(before: list[tuple[Any, Any]], after: list[tuple[Any, Any]]) -> bool:
    """Whether an item was added, removed or replaced (by identity) between the two."""
    return len(before) != len(after) or any(
        key != other_key or item is not other
        for (key, item), (other_key, other) in zip(before, after)
    )


def _torch_or_operator(target: Any) -> bool:
    known = _TORCH_OR_OPERATOR.get(target)
    if known is None:
        home = getattr(target, "__module__", None) or ""
        known = (
            target is getattr
            or home in ("_operator", "operator", "torch")
            or (home.startswith("torch.") and not home.startswith("torch.fx"))
        )
        _TORCH_OR_OPERATOR[target] = known
    return known


_TORCH_OR_OPERATOR: dict[Any, bool] = {}
_NO_SUBMODULES = nn.Module()
_FX_LOG = logging.getLogger("torch.fx.interpreter")  # fx.Interpreter.run_node's debug log


def is_meta_run(code: Any) -> bool:
    """Whether ``code`` is the frame that runs one node on meta: the frames it calls run a
    module or op for its value, not the traced step (:mod:`graphsplit.planning.opaque.sites`)."""
    return code is MetaInterpreter.run_on_meta.__code__


@contextlib.contextmanager
def meta_contexts() -> Iterator[None]:
    """Everything a node's meta run needs: the tracer's modes set aside, the meta execution
    and the eager protocols on meta (what :meth:`MetaInterpreter.run_on_meta` enters)."""
    with _TracerModesSetAside(), meta_execution(), eager_protocols_on_meta():
        yield


class _TracerModesSetAside:
    """Take the tracer's torch-function modes off the stack while a node runs on meta.

    The tracer's :class:`~graphsplit.planning.patching.torch_calls.TracedTorchCalls` mode lets
    every call through unchanged while the tracer computes a node's value
    (``tracer.computing_meta``), but as a Python mode it still costs a call into Python for each
    of the thousands of torch calls a large module makes. Only such modes on top of the stack are
    set aside (what is under them, a user's mode, stays), and they are put back in order on exit.
    A class rather than a generator context: it is entered once per traced node.
    """

    __slots__ = ("aside",)

    def __enter__(self) -> None:
        self.aside = aside = []
        while (
            _len_torch_function_stack() > 0
            and type(_get_function_stack_at(_len_torch_function_stack() - 1)) in _IDLE_ON_META
        ):
            aside.append(_pop_torch_function_stack())

    def __exit__(self, *exc_info: object) -> None:
        for mode in reversed(self.aside):
            _push_on_torch_function_stack(mode)


_IDLE_ON_META = frozenset({TracedTorchCalls})
