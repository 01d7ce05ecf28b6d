"""Facts about every node of a traced step, computed on ``meta`` tensors (no real weights).

Glossary:
    batch dim: found by running the graph at two batch sizes; the one dim whose size follows
        the batch size. ``None`` for values that do not change with it (per-dataset constants).
    batch-size value: a Python int equal to the batch size in both runs (``x.shape[0]``);
        stage 2 can read it off any cached tensor instead of the tensor it came from.
    per-sample: a tensor whose batch dim holds exactly one row per sample, so it can be cut
        into rows and cached. ``(2B, ...)`` layouts or flattened batches are not.
    random: the node ran an ATen op tagged ``nondeterministic_seeded`` with arguments that do
        draw (dropout with ``p=0`` or ``train=False`` and attention with ``dropout_p=0`` do not).
    mixes samples: the node combines samples of a batch (BatchNorm in train mode, a reduction
        over the batch, a select of one sample), so its value for one sample depends on which
        others share its batch; caching it per sample would be wrong.

In: :class:`~graphsplit.planning.trace.Traced`, the model (inside ``analysis_view``), example
inputs at two batch sizes. Out: ``node.meta["facts"]`` = :class:`NodeFacts` for every node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from graphsplit.errors import GraphsplitError, TraceError, user_error
from graphsplit.planning.meta import meta_execution
from graphsplit.planning.trace import Traced, execute, meta_failure

UNKNOWN = "unknown"


@dataclass(frozen=True)
class NodeFacts:
    """What graphsplit knows about one node's value and op."""

    is_tensor: bool
    type_name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    batch_dim: int | str | None  # an int, None (constant) or UNKNOWN (not per-sample)
    bytes_per_sample: int
    total_bytes: int
    depends_on_data: bool
    flops: int
    random_ops: tuple[str, ...]
    mixing: str | None  # why the node mixes samples, or None
    params: frozenset[str]  # qualified names of the parameters the node reads directly
    is_batch_size: bool = False  # a Python int equal to the batch size in both runs

    @property
    def per_sample(self) -> bool:
        return isinstance(self.batch_dim, int) and not isinstance(self.batch_dim, bool)

    @property
    def is_constant(self) -> bool:
        return self.batch_dim is None and not self.depends_on_data


# -- ATen-level observation ------------------------------------------------------------------
_DROPOUT_OPS = {
    "native_dropout",
    "dropout",
    "feature_dropout",
    "alpha_dropout",
    "feature_alpha_dropout",
}


def _argument(func, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if index < len(args):
                return args[index]
            return kwargs.get(name, default)
    return default


def _draws_randomness(func, args: tuple, kwargs: dict) -> bool:
    """Tagged ops may consume RNG; check the arguments that make them deterministic."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    op = func._schema.name.split("::")[-1]
    if op in _DROPOUT_OPS:
        return float(_argument(func, args, kwargs, "p", 0.0)) != 0.0 and bool(
            _argument(func, args, kwargs, "train", True)
        )
    if "attention" in op:
        return float(_argument(func, args, kwargs, "dropout_p", 0.0) or 0.0) != 0.0
    if op.startswith("bernoulli"):
        p = _argument(func, args, kwargs, "p", None)
        return not (isinstance(p, float) and p in (0.0, 1.0))
    if op == "rrelu_with_noise":
        return bool(_argument(func, args, kwargs, "training", False))
    return True


def _shapes(tree: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(leaf.shape) for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)
    )


class _OpRecorder(TorchDispatchMode):
    """Records, per node, the ATen ops it ran: name, input and output shapes, randomness."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple, tuple, bool, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if "batch_norm" in name and _argument(func, args, kwargs, "training", False):
            name = "batch_norm(training=True)"
        dims: tuple[int, ...] = ()
        if name.lstrip("_") in _ALONG_DIM_OPS:
            dim = _argument(func, args, kwargs, "dims", None)
            dim = _argument(func, args, kwargs, "dim", None) if dim is None else dim
            dims = tuple(dim) if isinstance(dim, (list, tuple)) else (() if dim is None else (dim,))
        self.ops.append(
            (name, _shapes((args, kwargs)), _shapes(out), _draws_randomness(func, args, kwargs),
             dims)
        )  # fmt: skip
        return out


# Ops whose output shape legitimately ignores their input's batch size.
_SHAPE_ONLY_OPS = {
    "sym_size",
    "sym_numel",
    "sym_stride",
    "new_empty",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty_strided",
    "_local_scalar_dense",
    "scalar_tensor",
}


# Ops that move or combine values along a dimension without changing its size: along the batch
# dimension they make one sample's result depend on the others (or on its position).
_ALONG_DIM_OPS = {
    "roll",
    "flip",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "sort",
    "argsort",
    "topk",
    "kthvalue",
    "softmax",
    "log_softmax",
    "index_select",
    "gather",
    "take_along_dim",
    "median",
    "mode",
    "scatter",
    "scatter_add",
    "index_add",
    "index_copy",
    "index_fill",
}


def _moves_along_batch(shape_a: tuple, shape_b: tuple, dims: tuple[int, ...]) -> bool:
    """Whether ``dims`` name the dimension of the first input that follows the batch size."""
    if len(shape_a) != len(shape_b) or not dims:
        return False
    batch_dims = {d for d, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b}
    return any(int(dim) % max(len(shape_a), 1) in batch_dims for dim in dims)


def _mixing_op(ops_a: list, ops_b: list) -> str | None:
    """The first op that combines samples: reduces/selects across, or moves along, the batch."""
    if len(ops_a) != len(ops_b) or any(a[0] != b[0] for a, b in zip(ops_a, ops_b)):
        return "runs different operations at different batch sizes"
    for (name, ins_a, outs_a, _, dims), (_, ins_b, outs_b, _, _) in zip(ops_a, ops_b):
        if name == "batch_norm(training=True)":
            return "BatchNorm in train mode normalises with batch statistics"
        if name in _SHAPE_ONLY_OPS or not outs_a:
            continue
        if ins_a != ins_b and outs_a == outs_b:
            return f"aten.{name} reduces or selects across the batch"
        if ins_a and ins_b and _moves_along_batch(ins_a[0], ins_b[0], dims):
            return f"aten.{name} moves values along the batch dimension"
    return None


def recording_observer(
    should_record: Callable[[fx.Node], bool],
) -> Callable[[fx.Node, Callable[[], Any]], Any]:
    """An observer for :func:`~graphsplit.planning.trace.trace_step` recording what ``_run`` would.

    It stores ``node.meta["ops"]`` and ``node.meta["flops"]`` for the nodes ``should_record``
    accepts, with the same modes in the same order as the analysis, so the first probe run
    reuses them instead of executing the model a second time at the traced batch size.
    """

    def observe(node: fx.Node, run: Callable[[], Any]) -> Any:
        if not should_record(node):
            return run()
        recorder = _OpRecorder()
        counter = FlopCounterMode(display=False)
        with recorder, counter:
            value = run()
        node.meta["ops"] = recorder.ops
        node.meta["flops"] = counter.get_total_flops()
        return value

    return observe


# -- running the graph -----------------------------------------------------------------------
@dataclass
class _Run:
    values: dict[fx.Node, Any]
    ops: dict[fx.Node, list]
    flops: dict[fx.Node, int]


def _run(
    traced: Traced,
    model: nn.Module,
    inputs: dict[str, Any],
    values: dict[fx.Node, Any],
    *,
    trainable_calls: frozenset[fx.Node] = frozenset(),
    reuse_trace: bool = False,
    skip: frozenset[fx.Node] = frozenset(),
) -> _Run:
    """Evaluate every node on meta; ``values`` is filled as it goes (kept if a node fails).

    ``trainable_calls`` (calls into modules holding trainable parameters) run in stage 2
    whatever they do, so they skip the op recording and FLOP counting; with ``reuse_trace``
    their value is the one the tracer already computed at this batch size. ``skip`` nodes are
    not run at all (their value is None).
    """
    ops: dict[fx.Node, list] = {}
    flops: dict[fx.Node, int] = {}
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            values[node] = inputs.get(node.target)
            continue
        if node.op == "output":
            continue
        if reuse_trace and node in trainable_calls:
            values[node] = node.meta["val"]
            continue
        if reuse_trace and "ops" in node.meta:  # observed while tracing, at this batch size
            values[node], ops[node], flops[node] = (
                node.meta["val"],
                node.meta["ops"],
                node.meta["flops"],
            )
            continue
        if node in skip:
            values[node] = None
            continue
        args = fx.node.map_arg(node.args, values.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
        recorder = _OpRecorder()
        # Both runs count FLOPs: the counter changes how some ops dispatch, and the mixing check
        # compares the two runs op by op.
        counter = FlopCounterMode(display=False)
        instrumented = node not in trainable_calls
        try:
            with meta_execution():
                if instrumented:
                    with recorder, counter:
                        values[node] = execute(model, traced.constants, node, args, kwargs)
                else:
                    values[node] = execute(model, traced.constants, node, args, kwargs)
        except GraphsplitError:
            raise
        except Exception as exc:
            raise meta_failure(node, exc) from exc
        ops[node] = recorder.ops
        flops[node] = counter.get_total_flops() if instrumented else 0
    return _Run(values, ops, flops)


def _check_guards(traced: Traced, values: dict[fx.Node, Any], batch_sizes: tuple[int, int]) -> None:
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
                source=guard.source,
                fix="use shapes inside tensor ops (x.view(x.shape[0], -1), torch.randn_like) "
                "instead of converting the batch size to a Python number or loop count",
            )


# -- facts -----------------------------------------------------------------------------------
def _is_metadata(value: Any) -> bool:
    """Values that describe tensors rather than hold their data."""
    if isinstance(value, (torch.device, torch.dtype, torch.Size, bool, int, float)):
        return True
    return isinstance(value, tuple) and all(isinstance(item, int) for item in value)


def batch_dim_of(shape_a: tuple, shape_b: tuple, batch_sizes: tuple[int, int]) -> int | str | None:
    """The dim that follows the batch size, None if none does, UNKNOWN if not one row/sample."""
    if len(shape_a) != len(shape_b):
        return UNKNOWN
    differing = [dim for dim, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b]
    if not differing:
        return None
    if len(differing) == 1:
        dim = differing[0]
        if (shape_a[dim], shape_b[dim]) == batch_sizes:
            return dim
    return UNKNOWN


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


def _tensor_facts(value_a: Any, value_b: Any, batch_sizes: tuple[int, int]) -> dict[str, Any]:
    type_name = f"{type(value_a).__module__}.{type(value_a).__qualname__}"
    if not isinstance(value_a, torch.Tensor) or not isinstance(value_b, torch.Tensor):
        is_batch_size = (
            type(value_a) is int and type(value_b) is int and (value_a, value_b) == batch_sizes
        )
        return {
            "is_tensor": False,
            "is_batch_size": is_batch_size,
            "type_name": type_name,
            "shape": None,
            "dtype": None,
            "batch_dim": UNKNOWN,
            "bytes_per_sample": 0,
            "total_bytes": 0,
        }
    batch_dim = batch_dim_of(tuple(value_a.shape), tuple(value_b.shape), batch_sizes)
    total = value_a.numel() * value_a.element_size()
    per_sample = total // batch_sizes[0] if isinstance(batch_dim, int) else 0
    return {
        "is_tensor": True,
        "is_batch_size": False,
        "type_name": "torch.Tensor",
        "shape": tuple(value_a.shape),
        "dtype": value_a.dtype,
        "batch_dim": batch_dim,
        "bytes_per_sample": per_sample,
        "total_bytes": total,
    }


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
        if node in trainable_calls or any(source in region for source in node.all_input_nodes):
            region.add(node)
    if any(guard.node in region for guard in traced.guards):
        return frozenset()
    region.discard(next(iter(n for n in traced.graph.nodes if n.op == "output")))
    return frozenset(region)


def analyze(
    traced: Traced,
    model: nn.Module,
    inputs: tuple[dict[str, Any], dict[str, Any]],
    batch_sizes: tuple[int, int],
    trainable_calls: frozenset[fx.Node] = frozenset(),
) -> None:
    """Write :class:`NodeFacts` to ``node.meta["facts"]`` for every node of ``traced.graph``.

    ``inputs`` are the example inputs as meta values at the two ``batch_sizes``; the model must
    be in ``analysis_view``. ``NodeFacts.params`` is filled by :func:`resolve_params` once the
    view is left, because parameters are identified by the real objects.
    """
    first = _run(traced, model, inputs[0], {}, trainable_calls=trainable_calls, reuse_trace=True)
    second_values: dict[fx.Node, Any] = {}
    skip = _unguarded_trainable_region(traced, trainable_calls)
    try:
        second = _run(
            traced,
            model,
            inputs[1],
            second_values,
            trainable_calls=trainable_calls,
            skip=skip,
        )
    except GraphsplitError:
        # A graph unrolled for one batch size often fails at another: name the real cause.
        _check_guards(traced, second_values, batch_sizes)
        raise
    _check_guards(traced, second.values, batch_sizes)
    batched_inputs = {
        name
        for name, value in inputs[0].items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_sizes[0]
    }
    depends: dict[fx.Node, bool] = {}
    for node in traced.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            depends[node] = node.target in batched_inputs
        else:
            # Shapes, devices and dtypes of data are not data: only values carry it along.
            depends[node] = any(
                depends[arg] and not _is_metadata(first.values[arg]) for arg in node.all_input_nodes
            )
        facts = _tensor_facts(first.values[node], second.values[node], batch_sizes)
        if node in skip:  # runs in stage 2 whatever it is: shape and type are enough
            facts = _tensor_facts(first.values[node], first.values[node], batch_sizes)
            facts["batch_dim"] = UNKNOWN
            facts["bytes_per_sample"] = 0
        if facts["is_tensor"] and isinstance(facts["batch_dim"], int) and not depends[node]:
            # Follows the batch size but not the data (torch.arange(B), torch.zeros(B, ...)):
            # a row belongs to a position in the batch, not to a sample, so it is not cached.
            facts["batch_dim"] = UNKNOWN
            facts["bytes_per_sample"] = 0
        mixing = (
            None if node in skip else _mixing_op(first.ops.get(node, []), second.ops.get(node, []))
        )
        if mixing is None and depends[node] and facts["is_tensor"] and facts["batch_dim"] is None:
            mixing = "its value depends on the batch's data but has no batch dimension"
        node.meta["facts"] = NodeFacts(
            depends_on_data=depends[node],
            flops=first.flops.get(node, 0),
            random_ops=tuple(sorted({op[0] for op in first.ops.get(node, []) if op[3]})),
            mixing=mixing,
            params=frozenset(),
            **facts,
        )


def resolve_params(traced: Traced, model: nn.Module, param_names: dict[int, str]) -> None:
    """Fill ``NodeFacts.params`` once the model's real parameters are back in place."""
    for node in traced.graph.nodes:
        facts = node.meta.get("facts")
        if facts is None or node.op not in ("get_attr", "call_module"):
            continue
        node.meta["facts"] = replace(facts, params=_params_read(node, model, param_names))
