"""The analysis's interpreter: one run of the whole graph on meta at one batch size.

Glossary:
    probe run: the graph run once on fake ``meta`` inputs of one batch size; the analysis
        makes two (:mod:`graphsplit.planning.analyse.node_facts`) and compares their values
        and op records.
    node mode: how a probe run treats one node (:class:`NodeMode`): run and record it, run it
        plainly, reuse what the tracer computed, or skip it.

In: the model, the traced constants and graph, the inputs by placeholder name, each node's
mode. Out: ``env`` (each node's value) and ``records`` (op records), filled as the run goes
and readable if a node fails:

    ProbeInterpreter(model, constants, graph, inputs, mode_of, batch_size=n).run()
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx
from torch import nn

from graphsplit.artifacts import OpRecord
from graphsplit.planning.meta.analysis_view import module_called
from graphsplit.planning.meta.meta_interpreter import MetaInterpreter, meta_contexts
from graphsplit.planning.meta.op_recorder import OP_RECORD
from graphsplit.planning.rules.opaque_call import is_opaque, probe_value


class NodeMode(enum.Enum):
    """How a probe run treats one node."""

    RECORD = "run it and record its ATen ops and FLOPs"
    RUN = "run it without recording (it runs in stage 2 whatever it does)"
    REUSE = "take the value (and op record, if any) the tracer computed at this batch size"
    SKIP = "do not run it; its value is None"


class ProbeInterpreter(MetaInterpreter):
    """One run of the whole graph at one batch size, each node treated as ``mode_of`` says.

    An opaque call is not run: its value at ``batch_size`` is the example run's, resized along
    each output's batch dim (:func:`~graphsplit.planning.rules.opaque_call.probe_value`).
    """

    def __init__(
        self,
        model: nn.Module,
        constants: Mapping[str, Any],
        graph: fx.Graph,
        inputs: Mapping[str, Any],
        mode_of: Callable[[fx.Node], NodeMode],
        *,
        batch_size: int = 0,
    ) -> None:
        super().__init__(model, graph, inputs, constants)
        self.mode_of = mode_of
        self.batch_size = batch_size
        self.records: dict[fx.Node, OpRecord] = {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run(*args, **kwargs)
        finally:
            self._leave_meta()

    def run_node(self, node: fx.Node) -> Any:
        if node.op in ("placeholder", "output"):
            self._leave_meta()
            return super().run_node(node)
        if is_opaque(node):
            self._leave_meta()
            self.records[node] = node.meta[OP_RECORD]
            return probe_value(node, self.batch_size)
        mode = self.mode_of(node)
        if mode is NodeMode.SKIP:
            return None
        if mode is NodeMode.REUSE:
            if OP_RECORD in node.meta:
                self.records[node] = node.meta[OP_RECORD]
            return node.meta["val"]
        self._enter_meta()
        value, record = self.run_on_meta(node, record=mode is NodeMode.RECORD)
        if record is not None:
            self.records[node] = record
        return value

    def call_module(self, target, args, kwargs) -> Any:
        module = self.model.get_submodule(target)
        return module_called(module, lambda: module(*args, **kwargs), args, kwargs)

    def _enter_meta(self) -> None:
        """Enter the meta contexts once for a run of consecutive meta nodes.

        Entering them costs about 20 µs (the fake mode's ``__enter__`` alone 5 µs), as much as
        running a small op: a 10k-node graph paid it once per node. Between two nodes of a
        probe only the interpreter's own bookkeeping runs, so the contexts stay entered until
        a node that must run outside them (an input, the output, an opaque call) or the end.
        """
        if self.on_meta is None:
            stack = contextlib.ExitStack()
            stack.enter_context(meta_contexts())
            self.on_meta = stack

    def _leave_meta(self) -> None:
        stack, self.on_meta = self.on_meta, None
        if stack is not None:
            stack.close()
