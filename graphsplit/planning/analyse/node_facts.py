"""Facts about every node of a traced step, computed on ``meta`` tensors (no real weights).

Glossary:
    probe run: one run of the traced graph on meta tensors at one batch size
        (:class:`~graphsplit.planning.meta.probe_interpreter.ProbeInterpreter`). Two runs, at
        two batch sizes, tell what follows the batch size.
    batch layout / batch dim: the one dim whose size follows the batch size holds one row per
        sample (``BatchLayout.PER_SAMPLE``, ``batch_dim`` that dim); values that do not change
        with it are ``CONSTANT`` (per-dataset constants); anything else is ``UNKNOWN``:
        ``(2B, ...)`` layouts, flattened batches, rows per batch *position*, non-tensors.
    batch-size value: a Python int equal to the batch size in both runs (``x.shape[0]``);
        stage 2 can read it off any cached tensor instead of the tensor it came from.
    random: the node ran an ATen op tagged ``nondeterministic_seeded`` with arguments that do
        draw (dropout with ``p=0`` or ``train=False`` and attention with ``dropout_p=0`` do not).
    mixes samples: see :mod:`graphsplit.planning.rules.mixing`.

In: :class:`~graphsplit.artifacts.Traced`, the model (inside ``analysis_view``),
:class:`~graphsplit.artifacts.ExampleInputs`. Out: ``node.meta["facts"]`` =
:class:`~graphsplit.artifacts.NodeFacts` for every node:

    analyze(traced, model, examples, *, trainable_calls) -> None
    resolve_params(traced, model, param_names) -> None   # once the real parameters are back
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import (
    BatchLayout,
    ExampleInputs,
    Mixing,
    MixingCause,
    NodeFacts,
    OpRecord,
    Traced,
)
from graphsplit.errors import Fix, GraphsplitError, TraceError, user_error
from graphsplit.planning.analyse.constant_grads import params_behind
from graphsplit.planning.meta.op_recorder import OP_RECORD
from graphsplit.planning.meta.probe_interpreter import NodeMode, ProbeInterpreter
from graphsplit.planning.rules.baked_sizes import fixed_number
from graphsplit.planning.rules.mixing import mixing_of
from graphsplit.planning.rules.user_lines import describe, frame_location_of

_NOTHING_RECORDED = OpRecord(ops=(), flops=0)


def analyze(
    traced: Traced,
    model: nn.Module,
    examples: ExampleInputs,
    *,
    trainable_calls: frozenset[fx.Node] = frozenset(),
) -> None:
    """Write :class:`NodeFacts` to ``node.meta["facts"]`` for every node of ``traced.graph``.

    The model must be in ``analysis_view``. ``trainable_calls`` (calls into modules holding
    trainable parameters) run in stage 2 whatever they do: neither run records their ops, the
    first reuses the value the tracer computed. ``NodeFacts.params`` is filled by
    :func:`resolve_params` once the view is left, because parameters are identified by the
    real objects.
    """
    batch_sizes = examples.batch_sizes

    def first_mode(node: fx.Node) -> NodeMode:  # at the traced batch size: reuse the trace
        reuse = node in trainable_calls or OP_RECORD in node.meta
        return NodeMode.REUSE if reuse else NodeMode.RECORD

    skip = _unguarded_trainable_region(traced, trainable_calls)

    def second_mode(node: fx.Node) -> NodeMode:
        if node in skip:
            return NodeMode.SKIP
        return NodeMode.RUN if node in trainable_calls else NodeMode.RECORD

    first = _probe(traced, model, examples.values[0], first_mode, batch_sizes[0])
    second = ProbeInterpreter(
        model,
        traced.constants,
        traced.graph,
        examples.values[1],
        second_mode,
        batch_size=batch_sizes[1],
    )
    try:
        second.run(enable_io_processing=False)
    except GraphsplitError:
        # A graph unrolled for one batch size often fails at another: name the real cause.
        _check_guards(traced, second.env, batch_sizes)
        raise
    _check_guards(traced, second.env, batch_sizes)
    depends = _data_dependence(traced.graph, examples, first.env)
    for node in traced.graph.nodes:
        if node.op == "output":
            continue
        skipped = node in skip  # runs in stage 2 whatever it is: shape and type are enough
        record = first.records.get(node, _NOTHING_RECORDED)
        mixing = None
        if not skipped:
            mixing = mixing_of(record.ops, second.records.get(node, _NOTHING_RECORDED).ops)
        node.meta["facts"] = _node_facts(
            first.env[node],
            first.env[node] if skipped else second.env[node],
            batch_sizes,
            depends_on_data=depends[node],
            skipped=skipped,
            record=record,
            mixing=mixing,
        )


def resolve_params(traced: Traced, model: nn.Module, param_names: dict[int, str]) -> None:
    """Fill ``NodeFacts.params`` once the model's real parameters are back in place."""
    for node in traced.graph.nodes:
        facts = node.meta.get("facts")
        if facts is None or node.op not in ("get_attr", "call_module"):
            continue
        read = _params_read(node, model, param_names)
        if not read and node.op == "get_attr":
            read = params_behind(node, traced.constants.get(str(node.target)), param_names)
        node.meta["facts"] = replace(facts, params=read)


def batch_layout_of(
    shape_a: tuple, shape_b: tuple, batch_sizes: tuple[int, int]
) -> tuple[BatchLayout, int | None]:
    """How a tensor of shape ``shape_a`` / ``shape_b`` at the two batch sizes holds the batch."""
    if len(shape_a) != len(shape_b):
        return BatchLayout.UNKNOWN, None
    differing = [dim for dim, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b]
    if not differing:
        return BatchLayout.CONSTANT, None
    if len(differing) == 1:
        dim = differing[0]
        if (shape_a[dim], shape_b[dim]) == batch_sizes:
            return BatchLayout.PER_SAMPLE, dim
    return BatchLayout.UNKNOWN, None


# -- the two probe runs ----------------------------------------------------------------------
def _probe(
    traced: Traced,
    model: nn.Module,
    inputs: Mapping[str, Any],
    mode_of: Callable[[fx.Node], NodeMode],
    batch_size: int,
) -> ProbeInterpreter:
    probe = ProbeInterpreter(
        model, traced.constants, traced.graph, inputs, mode_of, batch_size=batch_size
    )
    probe.run(enable_io_processing=False)
    return probe


def _unguarded_trainable_region(
    traced: Traced, trainable_calls: frozenset[fx.Node]
) -> frozenset[fx.Node]:
    """Calls into trainable modules and everything after them, if no guard reads that region.

    Those nodes run in stage 2 whatever their facts say, so the second run (the batch-dim
    probe) may skip them, which halves planning time for a big trainable model. A guard (a
    Python value the trace read) inside the region still needs its value at the second size.
    """
    region: set[fx.Node] = set()
    for node in traced.graph.nodes:
        if node in trainable_calls or any(arg in region for arg in node.all_input_nodes):
            region.add(node)
    if any(guard.node in region for guard in traced.guards):
        return frozenset()
    region.discard(next(iter(n for n in traced.graph.nodes if n.op == "output")))
    return frozenset(region)


def _check_guards(
    traced: Traced, values: Mapping[fx.Node, Any], batch_sizes: tuple[int, int]
) -> None:
    for guard in traced.guards:
        if guard.node not in values:
            continue
        try:
            value = guard.convert(values[guard.node])
        except Exception:  # the value changed type: also a batch-size dependence
            value = "<error>"
        if value != guard.value:
            raise user_error(
                TraceError,
                f"Python control flow depends on the batch size: it read {guard.value!r} at "
                f"batch size {batch_sizes[0]} and {value!r} at batch size {batch_sizes[1]}, so "
                "the traced step would only be valid for one batch size.",
                node=guard.node,
                source=_with_code(guard.source),
                fix=Fix(
                    "use shapes inside tensor ops (x.view(x.shape[0], -1), torch.randn_like) "
                    "instead of converting the batch size to a Python number or loop count; "
                    "where that code is a library's, split with a one-sample example batch: "
                    "the step is then planned one sample per batch (train with batches of one)"
                ),
            )


def _with_code(source: str) -> str:
    """``file:line  code`` for a guard's ``file:line`` (the loop's text says which loop)."""
    path, _, line = source.rpartition(":")
    return describe(frame_location_of(path, int(line))) if line.isdigit() else source


# -- facts -----------------------------------------------------------------------------------
def _is_metadata(value: Any) -> bool:
    """Values that describe tensors rather than hold their data."""
    if isinstance(value, (torch.device, torch.dtype, torch.Size, bool, int, float)):
        return True
    return isinstance(value, tuple) and all(isinstance(item, int) for item in value)


def _data_dependence(
    graph: fx.Graph, examples: ExampleInputs, values: Mapping[fx.Node, Any]
) -> dict[fx.Node, bool]:
    """Whether each node's value carries data of the batch (not just its shapes or devices)."""
    batch = examples.batch_sizes[0]
    batched_inputs = {
        name
        for name, value in examples.values[0].items()
        if any(  # a batch field, or a dict field holding one (ControlNet-SDXL's conditions)
            isinstance(item, torch.Tensor) and item.dim() > 0 and item.shape[0] == batch
            for item in (value.values() if type(value) is dict else (value,))
        )
    }
    depends: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            depends[node] = node.target in batched_inputs
        else:
            # Shapes, devices and dtypes of data are not data: only values carry it along.
            read = node.all_input_nodes
            if _reads_only_metadata_of_first(node):  # x.new_zeros(()), torch.zeros_like(x)
                read = [arg for arg in read if arg is not node.args[0]]
            elif _reads_only_metadata_of_others(node):  # pe.type_as(h), x.to(h)
                others = [*node.args[1:], *node.kwargs.values()]
                read = [arg for arg in read if arg is node.args[0] or arg not in others]
            depends[node] = any(depends[arg] and not _is_metadata(values[arg]) for arg in read)
    return depends


# Calls that read only the dtype, device (and shape) of their first argument, not its values.
_METADATA_METHODS = frozenset({"new_zeros", "new_ones", "new_empty", "new_full"})
_METADATA_FUNCTIONS = frozenset(
    {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
)


# Methods that read only the dtype, device or shape of their other tensor arguments: VideoMAE
# adds ``self.position_embeddings.detach().type_as(embeddings)``, a constant, to the batch's
# embeddings; taken as data of the batch, the constant had no batch dimension and kept the
# frozen encoder after it in stage 2.
_METADATA_OF_OTHERS = frozenset({"type_as", "view_as", "expand_as", "reshape_as", "to"})


def _reads_only_metadata_of_others(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in _METADATA_OF_OTHERS


def _reads_only_metadata_of_first(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    return node.op == "call_function" and node.target in _METADATA_FUNCTIONS


def _node_facts(
    value_a: Any,
    value_b: Any,
    batch_sizes: tuple[int, int],
    *,
    depends_on_data: bool,
    skipped: bool,
    record: OpRecord,
    mixing: Mixing | None,
) -> NodeFacts:
    """A node's facts, read off its values at the two batch sizes and its first run's ops.

    Built once per node (10k nodes make ``dataclasses.replace`` of a draft a cost of its own).
    ``skipped``: the second run skipped the node (``value_b`` is then ``value_a``), so no
    layout is known; ``mixing``: what :func:`mixing_of` found in the two runs' ops.
    """
    ops = {
        "flops": record.flops,
        "random_ops": tuple(sorted({op.name for op in record.ops if op.draws_random})),
    }
    if not isinstance(value_a, torch.Tensor) or not isinstance(value_b, torch.Tensor):
        return NodeFacts(
            is_tensor=False,
            type_name=f"{type(value_a).__module__}.{type(value_a).__qualname__}",
            shape=None,
            dtype=None,
            batch_layout=BatchLayout.UNKNOWN,
            batch_dim=None,
            bytes_per_sample=0,
            total_bytes=0,
            depends_on_data=depends_on_data,
            is_batch_size=(
                type(value_a) is int and type(value_b) is int and (value_a, value_b) == batch_sizes
            ),
            number=fixed_number(value_a, value_b),
            mixing=mixing,
            **ops,
        )
    layout, batch_dim = BatchLayout.UNKNOWN, None
    if not skipped:
        layout, batch_dim = batch_layout_of(tuple(value_a.shape), tuple(value_b.shape), batch_sizes)
    if layout is BatchLayout.PER_SAMPLE and not depends_on_data:
        # Follows the batch size but not the data (torch.arange(B), torch.zeros(B, ...)):
        # a row belongs to a position in the batch, not to a sample, so it is not cached.
        layout, batch_dim = BatchLayout.UNKNOWN, None
    if mixing is None and depends_on_data and layout is BatchLayout.CONSTANT:
        # A tensor computed from the batch's data that has no batch dim: it mixes the samples.
        mixing = Mixing(MixingCause.NO_BATCH_DIM)
    total = value_a.numel() * value_a.element_size()
    return NodeFacts(
        is_tensor=True,
        type_name="torch.Tensor",
        shape=tuple(value_a.shape),
        dtype=value_a.dtype,
        batch_layout=layout,
        batch_dim=batch_dim,
        bytes_per_sample=total // batch_sizes[0] if layout is BatchLayout.PER_SAMPLE else 0,
        total_bytes=total,
        depends_on_data=depends_on_data,
        mixing=mixing,
        **ops,
    )


def _params_read(node: fx.Node, model: nn.Module, name_of: dict[int, str]) -> frozenset[str]:
    if node.op not in ("get_attr", "call_module"):
        return frozenset()
    try:
        target = model.get_submodule(node.target) if node.op == "call_module" else None
        if target is None:
            owner, _, attr = node.target.rpartition(".")
            target = getattr(model.get_submodule(owner) if owner else model, attr)
    except AttributeError:  # a constant held by the trace, not the model
        return frozenset()
    if isinstance(target, nn.Module):
        return frozenset(name_of[id(p)] for p in target.parameters() if id(p) in name_of)
    if isinstance(target, nn.Parameter) and id(target) in name_of:
        return frozenset({name_of[id(target)]})
    return frozenset()
