"""The tracer's interpreter: each new node's meta value, computed as soon as it is created.

Glossary:
    example value: the fake ``meta`` value of a placeholder, by name (the example batch's twin).
    writes: the input nodes whose tensors a node wrote into (an in-place op, a module that
        mutates its argument), seen as moved version counters; left in ``node.meta["writes"]``
        for :mod:`graphsplit.planning.tracing.inplace`.

In: the model, the growing graph, the example values, which nodes to record. Out: each node's
value; its op record in ``node.meta["op_record"]`` when recorded:

    TracingInterpreter(model, graph, example_values, record=predicate).value_of(node) -> Any
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from graphsplit.planning.meta.meta_interpreter import MetaInterpreter
from graphsplit.planning.meta.op_recorder import OP_RECORD
from graphsplit.planning.patching.originals import python_isinstance
from graphsplit.planning.rules.opaque_call import is_opaque

# Where a node lists the input nodes whose tensors it wrote into (see
# planning/tracing/inplace.py).
WRITES = "writes"


class TracingInterpreter(MetaInterpreter):
    """Meta values for the tracer: each node is run once, as soon as it is created.

    The graph is still growing, so arguments come from ``node.meta["val"]`` (the tracer stores
    every node's value there). Nodes ``record`` accepts also get ``node.meta["op_record"]``,
    recorded exactly as a probe run would, so the analysis's first run reuses them instead of
    running the model a second time at the traced batch size.
    """

    def __init__(
        self,
        model: nn.Module,
        graph: fx.Graph,
        example_values: Mapping[str, Any],
        record: Callable[[fx.Node], bool] | None = None,
    ) -> None:
        super().__init__(model, graph, example_values, constants={})
        self.record = record

    def fetch_args_kwargs_from_env(self, node: fx.Node) -> tuple[tuple, dict]:
        args = fx.node.map_arg(node.args, lambda arg: arg.meta["val"])
        kwargs = fx.node.map_arg(node.kwargs, lambda arg: arg.meta["val"])
        return args, kwargs

    def value_of(self, node: fx.Node) -> Any:
        """``node``'s value on meta (placeholders: the example value of that name).

        Inputs the node wrote into (an in-place op, or a module that mutates its argument)
        are listed in ``node.meta["writes"]``: their tensors' version counters moved.
        """
        if node.op == "placeholder":
            return self.inputs.get(node.target)
        if is_opaque(node):  # run for real on the example batch (planning/opaque/sites.py)
            return node.target.planning.example_value(node)
        record = self.record is not None and self.record(node)
        versions = _versions(node)
        value, op_record = self.run_on_meta(node, record=record)
        if op_record is not None:
            node.meta[OP_RECORD] = op_record
        if versions:
            written = _written(versions)
            if written:
                node.meta[WRITES] = written
        return value


def _written(versions: list[tuple[fx.Node, int]]) -> tuple[fx.Node, ...]:
    """The inputs whose version counter moved since :func:`_versions` read them (each read
    afresh from its node), with torch functions disabled once for all of them."""
    with torch._C.DisableTorchFunction():
        return tuple([arg for arg, version in versions if _version(arg) != version])


def _version(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    if not python_isinstance(value, torch.Tensor):
        return None
    return None if value.is_inference() else value._version  # inference: no counter


def _versions(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """The version counter of every tensor input of ``node``: in-place writes bump it.

    Read with torch functions disabled and Python's own ``isinstance``: the values are fake
    tensors, never proxies, yet during a trace each ``._version`` read would go through the
    tracer's torch-function mode and each ``isinstance`` through the trace's replacement
    (:mod:`graphsplit.planning.patching.traced_builtins`), twice per input of every node.
    """
    versions = []
    with torch._C.DisableTorchFunction():
        for arg in node.all_input_nodes:
            value = arg.meta.get("val")
            if python_isinstance(value, torch.Tensor) and not value.is_inference():
                versions.append((arg, value._version))
    return versions
