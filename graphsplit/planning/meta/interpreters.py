"""Run a traced graph node by node on ``meta`` tensors: torch.fx Interpreters for the planning.

Glossary:
    meta run: every op executes on ``meta`` tensors inside
        :func:`~graphsplit.planning.meta.analysis_view.meta_execution`, so shapes, dtypes and FLOPs
        come out without real weights or data. A failing op raises a :class:`TraceError` naming the
        node.
    op record: the ATen ops one node ran (:class:`~graphsplit.artifacts.AtenOp`: name, shapes,
        whether it drew random numbers) and their FLOPs, as an
        :class:`~graphsplit.artifacts.OpRecord`. The analysis compares records at two batch
        sizes to find random draws, sample mixing and the work worth caching.
    node mode: how a probe run treats one node (:class:`NodeMode`): run and record it, run it
        plainly, reuse what the tracer computed, or skip it.

Two interpreters, both ``torch.fx.Interpreter``:

    TracingInterpreter(model, example_values, record=predicate).value_of(node) -> Any
        the tracer's: one node at a time while the graph is being built; arguments are read
        from ``node.meta["val"]``; accepted nodes get ``node.meta["op_record"]``.
    ProbeInterpreter(model, constants, graph, inputs, mode_of).run()
        the analysis's: the whole graph at one batch size; ``env`` (values) and ``records``
        (op records) are filled as it goes and stay readable if a node fails.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import nn
from torch._C import (
    _get_function_stack_at,
    _len_torch_function_stack,
    _pop_torch_function_stack,
    _push_on_torch_function_stack,
)
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, get_shape, shape_wrapper

from graphsplit.artifacts import AtenOp, OpRecord
from graphsplit.errors import GraphsplitError, TensorValueError, TraceError, user_error
from graphsplit.planning.meta import call_memo
from graphsplit.planning.meta.analysis_view import meta_execution, module_called, node_run, to_meta
from graphsplit.planning.meta.eager_protocols import eager_protocols_on_meta
from graphsplit.planning.patching.torch_calls import TracedTorchCalls
from graphsplit.planning.rules.mixing import ALONG_DIM_OPS, BATCH_NORM_TRAINING
from graphsplit.planning.rules.opaque_call import is_opaque, probe_value

# Where the tracer leaves a node's op record for the analysis's first probe run.
OP_RECORD = "op_record"
# Where it lists the input nodes whose tensors the node wrote into (see
# planning/tracing/inplace.py).
WRITES = "writes"


def fetch(model: nn.Module, constants: Mapping[str, Any], target: str) -> Any:
    """The object a ``get_attr`` / ``call_module`` target names."""
    if target in constants:
        return constants[target]
    value: Any = model
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def meta_failure(node: fx.Node, exc: Exception) -> TraceError:
    """A TraceError for an op that failed on meta tensors, the usual cause spelled out."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, _DATA_DEPENDENT) or _is_data_dependent(message):
        error = user_error(
            TensorValueError,
            f"The step reads the value of a tensor ({message}); graphsplit decides the split "
            "without real data, so values cannot steer the step.",
            node=node,
            fix="replace .item()/.tolist()/nonzero-style code with tensor ops (torch.where, "
            "masking), or move it into the data pipeline",
        )
        source, code = node.meta.get("source"), node.meta.get("source_code")
        error.read_at = f"{source}  {code}" if source and code else source  # the user's line
        return error
    return user_error(
        TraceError,
        f"Running this operation on meta tensors failed: {type(exc).__name__}: {message}",
        node=node,
        fix="make the step device-agnostic (take devices from input tensors, avoid .cpu()/"
        ".numpy()); if the failure is inside a library module, report it with this message",
    )


# What the fake mode raises when an op's result (or output shape) depends on tensor values.
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def _is_data_dependent(message: str) -> bool:
    """Real meta tensors (outside the fake mode) only say so in their message."""
    markers = ("meta tensor", "_local_scalar_dense", "data-dependent", "item()", "tolist")
    return any(marker in message for marker in markers)


# -- ATen-level recording ---------------------------------------------------------------------
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
    elif kind not in _ATOMS:
        shapes.extend(
            tuple(leaf.shape) for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)
        )


# Leaves with no tensor inside: what a recorded op's arguments mostly are besides tensors.
_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size})


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
    if kind in _ATOMS:
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


class _OpRecorder(TorchDispatchMode):
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


call_memo.RECORDERS.add(_OpRecorder)  # a memoised module call appends its ops again


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


def _recorded(run: Callable[[], Any]) -> tuple[Any, OpRecord]:
    recorder = _OpRecorder()
    with recorder:
        value = run()
    return value, OpRecord(tuple(recorder.ops), recorder.flops)


# -- interpreters -----------------------------------------------------------------------------
class _MetaInterpreter(fx.Interpreter):
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
        return self.model.get_submodule(target)(*args, **kwargs)

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
            return _recorded(lambda: self._run_node_plainly(node))
        return self._run_node_plainly(node), None

    def run_on_meta(self, node: fx.Node, *, record: bool) -> tuple[Any, OpRecord | None]:
        """Run one node on meta (recording its ops if asked); failures become TraceErrors.

        A node that repeats an earlier pure one (same function or module state, same
        argument metadata) is answered by the analysis's memo (:func:`call_memo.node_run`).
        """
        try:
            head, module = self._memo_head(node)
            if head is None:
                return self._run_on_meta(node, record=record)
            return node_run(
                head,
                module,
                record,
                lambda: self._run_on_meta(node, record=record),
                self.fetch_args_kwargs_from_env(node),
            )
        except GraphsplitError:
            raise
        except Exception as exc:
            raise meta_failure(node, exc) from exc

    def _run_on_meta(self, node: fx.Node, *, record: bool) -> tuple[Any, OpRecord | None]:
        if self.on_meta is not None:  # a probe holds the contexts (see _enter_meta)
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
    return code is _MetaInterpreter.run_on_meta.__code__


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """Everything a node's meta run needs: the tracer's modes set aside, the meta execution
    and the eager protocols on meta (what :meth:`_MetaInterpreter.run_on_meta` enters)."""
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


class TracingInterpreter(_MetaInterpreter):
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
        written = tuple(arg for arg, version in versions if _version(arg) != version)
        if written:
            node.meta[WRITES] = written
        return value


def _version(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    if not _PYTHON_ISINSTANCE(value, torch.Tensor):
        return None
    with torch._C.DisableTorchFunction():
        return value._version


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
            if _PYTHON_ISINSTANCE(value, torch.Tensor):
                versions.append((arg, value._version))
    return versions


# Bound when this module is imported, before any trace replaces ``builtins.isinstance``.
_PYTHON_ISINSTANCE = isinstance


class NodeMode(enum.Enum):
    """How a probe run treats one node."""

    RECORD = "run it and record its ATen ops and FLOPs"
    RUN = "run it without recording (it runs in stage 2 whatever it does)"
    REUSE = "take the value (and op record, if any) the tracer computed at this batch size"
    SKIP = "do not run it; its value is None"


class ProbeInterpreter(_MetaInterpreter):
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
            stack.enter_context(_on_meta())
            self.on_meta = stack

    def _leave_meta(self) -> None:
        stack, self.on_meta = self.on_meta, None
        if stack is not None:
            stack.close()
