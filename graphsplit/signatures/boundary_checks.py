"""Stage 2's size checks, run by stage 1 on the boundary it made: no row is cached that its
plan cannot train.

A plan's stage 2 may hold size checks of boundary tensors (FLUX's latent packing turns
``latents.shape[3] * vae_scale_factor`` into a literal: stage 2 checks it). Stage 1 alone never
reads that size, so a batch of another width would pass stage 1, be cached under this plan and
be refused at its first stage-2 batch, after the whole cache was written. The dispatcher
therefore runs, after a plan's stage 1, the part of its stage 2 that computes and checks those
sizes: a small GraphModule cut out of stage 2 holding each check and the torch functions and
methods it reads (``latents.to(dtype).shape[3] * 2``), run on ``meta`` tensors of the
boundary's shapes, so no number is computed and no weight is read. A check that reads a
module's output, or that ``meta`` tensors cannot compute (a value read with ``.item()``), stays
in stage 2 alone. A shape that passed is remembered, so a bucket costs one meta run.

In and out::

    SizeChecks.of(stage2) -> SizeChecks | None     # None: stage 2 holds no such check
    checks.run(outputs)                            # raises PlanMismatch, as stage 2 would
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from graphsplit.planning.rules.random_draws import generator_states, set_generator_states
from graphsplit.runtime import PlanMismatch, check_size, check_size_read

__all__ = ["SizeChecks"]

_CHECKS = (check_size, check_size_read)


def _ancestors(node: fx.Node) -> set[fx.Node] | None:
    """The nodes ``node`` reads, transitively; None when one of them calls a module (its
    weights are not meta) or is not a function, method or attribute."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        if current.op not in ("placeholder", "get_attr", "call_function", "call_method"):
            return None
        seen.add(current)
        todo.extend(current.all_input_nodes)
    return seen


def _onto_meta(node: fx.Node) -> None:
    """Make a copied node compute on ``meta``: a ``device=`` it names (``.to(device="cuda")``,
    ``torch.zeros(..., device="cpu")``, ``.cpu()``) becomes ``"meta"``, which keeps every
    shape."""
    if "device" in node.kwargs:
        node.kwargs = {**node.kwargs, "device": "meta"}
    if node.op == "call_method" and node.target in ("cpu", "cuda"):
        node.target, node.args, node.kwargs = "to", (node.args[0], "meta"), {}
    if node.op == "call_method" and node.target == "to":
        node.args = tuple(
            "meta" if isinstance(arg, (str, torch.device)) else arg for arg in node.args
        )


def _on_meta(value: Any) -> Any:
    return value.detach().to("meta") if isinstance(value, torch.Tensor) else value


class _Check:
    """One check of stage 2 and what it reads, as a GraphModule over boundary tensors."""

    def __init__(self, module: fx.GraphModule) -> None:
        self.module = module
        self.names = tuple(
            str(node.target) for node in module.graph.nodes if node.op == "placeholder"
        )
        self.passed: set[tuple[Any, ...]] = set()  # boundary shapes it passed
        self.broken = False  # meta tensors cannot run it: stage 2 checks it alone

    def run(self, outputs: Mapping[str, Any]) -> None:
        if self.broken or not all(name in outputs for name in self.names):
            return
        values = [outputs[name] for name in self.names]
        shapes = tuple(
            (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in values
        )
        if shapes in self.passed:
            return
        try:
            # forward itself: GraphModule.__call__ prints the generated code of any error.
            self.module.forward(
                **{name: _on_meta(v) for name, v in zip(self.names, values, strict=True)}
            )
        except PlanMismatch:
            raise
        except Exception:  # not computable on meta (a value read): stage 2 checks it
            self.broken = True
            return
        self.passed.add(shapes)


def _cut_out(stage2: fx.GraphModule, kept: set[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in stage2.graph.nodes:  # topological order
        if node in kept:
            copies[node] = graph.node_copy(node, lambda n: copies[n])
            if node.op == "placeholder":
                copies[node].args = ()  # no default: the boundary tensor is always given
            _onto_meta(copies[node])
    graph.output(None)
    module = fx.GraphModule(stage2, graph, class_name="SizeCheck")
    for node in graph.nodes:  # constants stage 2 reads become meta tensors too
        if node.op == "get_attr":
            owner_name, _, name = str(node.target).rpartition(".")
            owner = module.get_submodule(owner_name)
            value = getattr(owner, name)
            if isinstance(value, torch.Tensor):
                owner._parameters.pop(name, None)
                owner._buffers.pop(name, None)
                setattr(owner, name, _on_meta(value))
    return module


class SizeChecks:
    """Stage 2's checks that boundary shapes decide, cut out of it and run on ``meta``, each
    on its own (one that ``meta`` cannot compute leaves the others running)."""

    def __init__(self, checks: list[_Check]) -> None:
        self.checks = checks

    @classmethod
    def of(cls, stage2: fx.GraphModule) -> SizeChecks | None:
        """The checks of ``stage2`` computable from boundary shapes (see the module
        docstring); None when there are none."""
        checks = []
        for node in stage2.graph.nodes:
            if node.op == "call_function" and node.target in _CHECKS:
                ancestors = _ancestors(node)
                if ancestors is not None:
                    checks.append(_Check(_cut_out(stage2, ancestors)))
        return cls(checks) if checks else None

    @property
    def names(self) -> tuple[str, ...]:
        """The boundary tensors the checks read."""
        return tuple(dict.fromkeys(name for check in self.checks for name in check.names))

    def run(self, outputs: Mapping[str, Any]) -> None:
        """Check stage 1's ``outputs`` as stage 2 would; raises its ``PlanMismatch``. A check
        whose tensor stage 1 did not return is stage 2's alone."""
        states = generator_states()  # a draw on meta must not move a generator
        try:
            for check in self.checks:
                check.run(outputs)
        finally:
            set_generator_states(states)
