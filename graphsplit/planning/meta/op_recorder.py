"""Record the ATen ops one node runs on meta, and their FLOPs: a node's op record.

Glossary:
    op record: the ATen ops one node ran (:class:`~graphsplit.artifacts.AtenOp`: name, the
        shapes in and out, whether it drew random numbers, the dims it works along) and their
        FLOPs, as an :class:`~graphsplit.artifacts.OpRecord`. The analysis compares records at
        two batch sizes to find random draws, sample mixing and the work worth caching.
    FLOPs: counted by torch's own formulas (``torch.utils.flop_counter.flop_registry``),
        exactly as ``FlopCounterMode`` counts them.

In: a function that runs one node on meta. Out: its value and op record.

    recorded(run) -> (value, OpRecord)
    OpRecorder(): a TorchDispatchMode whose ``ops`` and ``flops`` grow as ops run under it
    draws_randomness(func, args, kwargs) -> bool
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, get_shape, shape_wrapper

from graphsplit.artifacts import AtenOp, OpRecord
from graphsplit.planning.meta import call_memo
from graphsplit.planning.patching.originals import PLAIN_VALUE_TYPES
from graphsplit.planning.rules.mixing import ALONG_DIM_OPS, BATCH_NORM_TRAINING

# Where the tracer leaves a node's op record for the analysis's first probe run.
OP_RECORD = "op_record"

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


def draws_randomness(func, args: tuple, kwargs: dict) -> bool:
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
    """The shape of every tensor in ``tree``, in ``pytree.tree_leaves`` order.

    Runs twice per recorded op, so plain tuples, lists and dicts are walked directly (the
    same order as pytree's); anything else (``ModelOutput``, named tuples) goes through pytree.
    """
    shapes: list[tuple[int, ...]] = []
    _collect_shapes(tree, shapes)
    return tuple(shapes)


def _collect_shapes(tree: Any, shapes: list[tuple[int, ...]]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _collect_shapes(item, shapes)
    elif kind is dict:
        for item in tree.values():
            _collect_shapes(item, shapes)
    elif isinstance(tree, torch.Tensor):
        shapes.append(tuple(tree.shape))
    elif kind not in PLAIN_VALUE_TYPES:
        shapes.extend(
            tuple(leaf.shape) for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)
        )


def _shape_tree(tree: Any) -> Any:
    """``tree`` with every tensor replaced by its shape: what ``flop_counter.shape_wrapper``
    computes with ``pytree.tree_map`` (plain containers rebuilt directly, as pytree would)."""
    kind = type(tree)
    if kind is tuple:
        return tuple([_shape_tree(item) for item in tree])
    if kind is list:
        return [_shape_tree(item) for item in tree]
    if kind is dict:
        return {key: _shape_tree(item) for key, item in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree.shape
    if kind in PLAIN_VALUE_TYPES:
        return tree
    return pytree.tree_map(get_shape, tree)


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op by torch's formula (``flop_registry``), as ``FlopCounterMode`` counts.

    Most formulas are registered wrapped in ``shape_wrapper``, which maps the arguments to
    shapes with ``pytree.tree_map``; the wrapped formula is called here with the same shapes,
    mapped by :func:`_shape_tree` (a third of a recorded op's cost went to that map).
    """
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    if getattr(formula, "__code__", None) is not _SHAPE_WRAPPED or not hasattr(
        formula, "__wrapped__"
    ):
        return formula(*args, **kwargs, out_val=out)
    args, kwargs, out_shape = _shape_tree((args, kwargs, out))
    return formula.__wrapped__(*args, out_shape=out_shape, **kwargs)


# The code object of every formula ``shape_wrapper`` wrapped (its inner ``nf``).
_SHAPE_WRAPPED = shape_wrapper(lambda: 0).__code__


class OpRecorder(TorchDispatchMode):
    """Records the ATen ops run under it: name, input and output shapes, randomness, dims, FLOPs.

    FLOPs are counted here, from torch's own formulas (``torch.utils.flop_counter``), exactly
    as ``FlopCounterMode`` counts them: an op is first offered its decomposition (so composite
    ops are recorded as the ops they run, which the mixing check compares run against run),
    and the ops that execute are counted. One mode instead of two halves the Python work per
    op, and no module hooks are installed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[AtenOp] = []
        self.flops = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as OpMemo's: no torch._disable_dynamo frame around every op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SIZE_QUERIES:  # FlopCounterMode leaves these alone too
            return func(*args, **kwargs)
        if func is not _DEVICE and _decomposes(func):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        self.flops += _flops(func, args, kwargs, out)
        name, along_dim = _name_of(func)
        if "batch_norm" in name and _argument(func, args, kwargs, "training", False):
            name = BATCH_NORM_TRAINING
        dims: tuple[int, ...] = ()
        if along_dim:
            dim = _argument(func, args, kwargs, "dims", None)
            dim = _argument(func, args, kwargs, "dim", None) if dim is None else dim
            dims = tuple(dim) if isinstance(dim, (list, tuple)) else (() if dim is None else (dim,))
        random = draws_randomness(func, args, kwargs)
        self.ops.append(AtenOp(name, _shapes((args, kwargs)), _shapes(out), random, dims))
        return out


call_memo.RECORDERS.add(OpRecorder)  # a memoised module call appends its ops again


def _name_of(func: Any) -> tuple[str, bool]:
    """An overload's op name (``"addmm"``) and whether it works along given dims, once each."""
    known = _NAMES.get(func)
    if known is None:
        name = func._schema.name.split("::")[-1]
        known = _NAMES[func] = (name, name.lstrip("_") in ALONG_DIM_OPS)
    return known


_NAMES: dict[Any, tuple[str, bool]] = {}
_DEVICE = torch.ops.prim.device.default
# Metadata queries FlopCounterMode passes over (they only reach a mode for exotic layouts).
_SIZE_QUERIES = frozenset(
    {
        torch.ops.aten.sym_is_contiguous.default,
        torch.ops.aten.is_contiguous.default,
        torch.ops.aten.is_contiguous.memory_format,
        torch.ops.aten.is_strides_like_format.default,
        torch.ops.aten.is_non_overlapping_and_dense.default,
        torch.ops.aten.size.default,
        torch.ops.aten.sym_size.default,
        torch.ops.aten.stride.default,
        torch.ops.aten.sym_stride.default,
        torch.ops.aten.storage_offset.default,
        torch.ops.aten.sym_storage_offset.default,
        torch.ops.aten.numel.default,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.dim.default,
        torch.ops.prim.layout.default,
    }
)


def _decomposes(func: Any) -> bool:
    """Whether ``func.decompose`` may run a decomposition (else it returns NotImplemented).

    That depends on the overload only (``OpOverload.decompose`` looks for a
    CompositeImplicitAutograd kernel), so it is decided once per overload: entering the
    recorder around a call that can only answer NotImplemented costs a mode push per op.
    """
    known = _DECOMPOSES.get(func)
    if known is None:
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        known = not isinstance(func, torch._ops.OpOverload) or (
            key in func.py_kernels
            or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
        )
        _DECOMPOSES[func] = known
    return known


_DECOMPOSES: dict[Any, bool] = {}


def recorded(run: Callable[[], Any]) -> tuple[Any, OpRecord]:
    """``run()``'s value and the op record of the ATen ops it ran."""
    recorder = OpRecorder()
    with recorder:
        value = run()
    return value, OpRecord(tuple(recorder.ops), recorder.flops)
