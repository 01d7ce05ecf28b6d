"""Trace a training step into a torch.fx graph at the level of the user's code.

Glossary:
    leaf module: a submodule recorded as one ``call_module`` node instead of being traced into.
        Modules whose parameters are all frozen or all trainable are leaves (so stage 2 calls
        the user's own trainable modules: their forward, hooks and checkpointing stay theirs).
        Modules that mix both are traced into when :func:`trace_step` is asked to.
    leaf method call: ``vae.encode(x)`` on a leaf module, recorded as ``get_attr(vae)`` followed
        by ``call_method(encode)``, just like ``forward`` (see
        :mod:`graphsplit.planning.patching.leaf_methods`); a mixed module's methods are traced into.
    meta value: every node carries ``node.meta["val"]``, the value its op produced on ``meta``
        tensors (:class:`~graphsplit.planning.meta.tracing_interpreter.TracingInterpreter`).
        Control flow on shapes, ranks, dtypes, devices reads these; on tensor *values* it
        raises :class:`~graphsplit.errors.TraceError`.
    guard: a Python value the trace read from a meta value (a ``len``, ``bool``, ``int``,
        ``__index__``), kept so the analysis can check it does not change with the batch size;
        also listed in ``node.meta["guards"]``, where stage 2 finds the sizes to recheck
        (:mod:`graphsplit.planning.rules.size_guards`).
    traced value: a proxy that answers ``isinstance``, ``callable`` and ``len`` as its meta
        value would, so library code runs the branch eager runs (:mod:`.proxies`,
        :mod:`..patching.traced_builtins`).
    patcher: every change the trace makes to the process (Python's builtins, torch's
        functions, the leaves' methods) is registered with one
        :class:`~graphsplit.planning.patching.patcher.Patcher` and undone by it, however the
        trace ends; traces in several threads run one at a time.
    checkpoint region: nodes traced inside ``torch.utils.checkpoint.checkpoint``, tagged
        ``node.meta["checkpoint"]`` (:mod:`graphsplit.planning.rules.checkpoint`).
    module writes: the step's own, marked on leaf calls (:mod:`..patching.module_writes`).

In: the model, example inputs as meta values, the names of modules to trace into.
Out: :class:`~graphsplit.artifacts.Traced` — the graph, the constants it references, its guards:

    trace_step(model, example_values, leaf_names, *, record=None) -> Traced
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import Guard, Traced
from graphsplit.errors import Fix, GraphsplitError, TensorValueError, TraceError, user_error
from graphsplit.planning.meta.analysis_view import module_called
from graphsplit.planning.meta.tracing_interpreter import TracingInterpreter
from graphsplit.planning.opaque.value_reads import NOT_ANSWERED, Read, answer
from graphsplit.planning.patching.autograd_functions import record_autograd_functions
from graphsplit.planning.patching.checkpoint_regions import record_checkpoints
from graphsplit.planning.patching.einops_calls import record_einops_calls
from graphsplit.planning.patching.leaf_methods import record_leaf_methods
from graphsplit.planning.patching.module_state import module_state_restored
from graphsplit.planning.patching.module_writes import ModuleWrites, record_module_writes
from graphsplit.planning.patching.originals import python_len
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.torch_calls import record_torch_calls
from graphsplit.planning.patching.traced_arguments import (
    accept_traced_sizes,
    assume_tensor_checks,
    record_legacy_constructor,
)
from graphsplit.planning.patching.traced_builtins import replace_python_builtins, replace_range
from graphsplit.planning.patching.traced_values import holds_an_object_fx_cannot_hold
from graphsplit.planning.rules.checkpoint import CHECKPOINT, CheckpointRegion
from graphsplit.planning.rules.grad_modes import check_autocast, current_modes, mark_switched
from graphsplit.planning.rules.random_draws import (
    changed_generators,
    generator_states,
    random_draw_refusal,
    set_generator_states,
)
from graphsplit.planning.rules.size_guards import GUARDS
from graphsplit.planning.rules.user_lines import (
    current_line,
    current_location,
    definition_of,
    frame_location,
    user_frame,
)
from graphsplit.planning.step.example_inputs import defaults_not_given
from graphsplit.planning.tracing.inplace import functionalize_inplace
from graphsplit.planning.tracing.int_calls import INT_SITES, handed_out
from graphsplit.planning.tracing.proxies import (
    PLAIN_ARGUMENTS,
    TracedAttribute,
    TracedValue,
    dict_view_items,
    refuse_a_size_as_key,
    refuse_traced_text,
    texts_reaching,
)
from graphsplit.planning.tracing.rewrites import restore_input_names

_MAX_NAME = 48
# Python reads of a tensor's value the planning can answer (planning/opaque/value_reads.py).
_VALUE_READS = {bool: Read.BOOL, int: Read.INT, float: Read.FLOAT, operator.index: Read.INDEX}


class StepTracer(fx.Tracer):
    """fx tracer whose proxies carry meta values and whose leaves include method calls."""

    def __init__(self, leaf_names: frozenset[str], example_values: dict[str, Any]) -> None:
        super().__init__(autowrap_modules=(math,), param_shapes_constant=False)
        # A buffer read in traced code is a get_attr node, as a parameter is: fx's default
        # hands the tensor itself to the code, and ``self.table[:4]`` then ran on the analysis
        # view's meta twin, its result a meta constant stage 1 could never run with.
        self.proxy_buffer_attributes = True
        self.leaf_names = leaf_names
        self.through: set[str] = set()  # leaves traced through for this call (call_module)
        self.example_values = example_values
        self.guards: list[Guard] = []
        # __index__ guards and the user instruction that read them (see concrete()).
        self.pending_guards: list[tuple[Guard, tuple[int, int]]] = []
        # str() / format() of sizes: guards once the text reaches a node (proxies.py).
        self.texts: list[Guard] = []
        # The checkpoint() call being traced, if any (see patches.checkpoints_recorded).
        self.checkpoint: CheckpointRegion | None = None
        self.checkpoint_count = 0
        self.computing_meta = False
        self.module_proxies: dict[str, TracedValue] = {}
        self.forward_location: tuple[str, str] = ("<unknown>", "")
        # Which nodes get an op record while traced (see TracingInterpreter).
        self.record: Callable[[fx.Node], bool] | None = None
        self.interpreter: TracingInterpreter | None = None
        self.module_writes: ModuleWrites | None = None  # the step's writes into its modules
        # The caller's grad mode and autocast: a node created under others was inside a `with`
        # block of the step, which stage code would not have (planning/rules/grad_modes.py).
        self.ambient_modes = current_modes()

    # -- graph construction -------------------------------------------------------------
    def proxy(self, node: fx.Node) -> TracedValue:
        return TracedValue(node, self)

    def create_arg(self, a: Any) -> Any:
        # Proxies first (a traced tensor claims to be a torch.Tensor, see python_builtins: fx
        # would store it away as a constant), plain types to fx's own handler (proxies.py).
        if (plain := PLAIN_ARGUMENTS.get(type(a))) is not None:
            return plain(self, a)
        return a.node if isinstance(a, fx.Proxy) else super().create_arg(a)

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if qualified_name in self.through:  # handed an object no node can hold: traced through
            return False
        return qualified_name in self.leaf_names or super().is_leaf_module(module, qualified_name)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        self.keep_pending_guards()
        if self.texts:
            self.guards.extend(texts_reaching(self.texts, (args, kwargs)))
        if name is None:
            name = _descriptive_name(kind, target, args)
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self.checkpoint is not None and kind not in ("placeholder", "output"):
            node.meta[CHECKPOINT] = self.checkpoint
        if kind == "placeholder":
            node.meta["source"], node.meta["source_code"] = self.forward_location
            node.meta["val"] = self._meta_value(node)
        elif kind != "output":
            node.meta["source"], node.meta["source_code"] = current_location()
            mark_switched(node, self.ambient_modes)
            node.meta["val"] = self._meta_value(node)
            if self.module_writes is not None:
                self.module_writes.mark(node, self.module_proxies)
        return node

    def call_module(self, module, forward, args, kwargs):
        if self.computing_meta:  # a module inside a node's meta run (or a real run)
            return module_called(module, lambda: forward(*args, **kwargs), args, kwargs)
        if self.submodule_paths is not None and module not in self.submodule_paths:
            return self._call_foreign_module(module, forward, args, kwargs)
        if not holds_an_object_fx_cannot_hold((args, kwargs)):
            return super().call_module(module, forward, args, kwargs)
        self.through.add(path := self.path_of_module(module))
        try:
            return super().call_module(module, forward, args, kwargs)
        finally:
            self.through.discard(path)

    def _call_foreign_module(self, module, forward, args, kwargs):
        """A module the step holds nowhere in its tree (``loss_fct = CrossEntropyLoss()``
        created inside ``forward``): traced through, so the graph holds what it computes.

        A ``call_module`` node needs a path in the model, and stage code would have no module
        to call. Without parameters, tracing through its forward is exact (its buffers, if any,
        become constants of the graph); with parameters, its weights would be frozen into the
        plan as constants and never trained, so that is refused.
        """
        owned = next((name for name, _ in module.named_parameters()), None)
        if owned is not None:
            kind = type(module).__name__
            raise user_error(
                TraceError,
                f"The step calls a {kind} that is not a submodule of the model, and it holds "
                f"parameters ({owned}, ...): graphsplit would freeze them into the plan as "
                "constants, and stage 2 could not train them.",
                source=current_line(),
                fix=Fix(
                    f"create it once, as an attribute of the model (self.name = {kind}(...) in "
                    "__init__; for a function step, a global or an argument of the function), "
                    "so it is a submodule graphsplit can place in a stage"
                ),
            )
        return forward(*args, **kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.computing_meta:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def record_call(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One ``call_function`` node for a torch call that holds no traced value.

        Generators become attributes of the root (read by ``get_attr``): stage code draws from
        the user's own generator object, as the step did.
        """
        args, kwargs = torch.utils._pytree.tree_map_only(
            torch.Generator, self._generator_attribute, (args, kwargs)
        )
        return self.create_proxy("call_function", function, args, kwargs)

    def _generator_attribute(self, generator: torch.Generator) -> TracedValue:
        for name, value in vars(self.root).items():
            if value is generator:
                return self.create_proxy("get_attr", name, (), {})
        name = f"_generator_{sum(isinstance(v, torch.Generator) for v in vars(self.root).values())}"
        setattr(self.root, name, generator)
        return self.create_proxy("get_attr", name, (), {})

    def open_checkpoint(self, options: dict[str, Any] | None) -> CheckpointRegion | None:
        """Start tagging nodes with a new checkpoint region (unless one is open already)."""
        if self.checkpoint is not None:
            return None
        if options is not None:
            self.checkpoint = CheckpointRegion(self.checkpoint_count, options)
            self.checkpoint_count += 1
        return self.checkpoint

    def close_checkpoint(self, token: CheckpointRegion | None) -> None:
        if token is not None and token is self.checkpoint:
            self.checkpoint = None

    @contextlib.contextmanager
    def rolled_back_on_error(self) -> Iterator[None]:
        """Undo a failed attempt to trace into a call (its nodes, guards, handles); no raise."""
        count = len(self.graph.nodes)
        guards, pending, texts = len(self.guards), len(self.pending_guards), list(self.texts)
        handles, region = dict(self.module_proxies), self.checkpoint
        try:
            yield
        except Exception:
            for node in reversed(list(self.graph.nodes)[count:]):
                self.graph.erase_node(node)
            del self.guards[guards:]
            del self.pending_guards[pending:]
            self.texts[:] = texts
            self.module_proxies, self.checkpoint = handles, region

    def module_proxy(self, qualified_name: str) -> TracedValue:
        """One ``get_attr`` node per leaf module whose methods the step calls."""
        if qualified_name not in self.module_proxies:
            self.module_proxies[qualified_name] = self.create_proxy(
                "get_attr", qualified_name, (), {}
            )
        return self.module_proxies[qualified_name]

    # -- meta values ----------------------------------------------------------------------
    def _meta_value(self, node: fx.Node) -> Any:
        if self.interpreter is None:  # the root and graph exist once tracing has started
            self.interpreter = TracingInterpreter(
                self.root, self.graph, self.example_values, self.record
            )
        self.computing_meta = True
        try:
            return self.interpreter.value_of(node)
        finally:
            self.computing_meta = False

    # -- Python conversions of traced values ---------------------------------------------
    def concrete(
        self, proxy: TracedValue, convert: Callable[[Any], Any], *, pending: bool = False
    ) -> Any:
        """Resolve a Python conversion from the meta value; refuse it on tensor data.

        ``pending`` (``__index__``): torch's argument parser also calls ``__index__`` on the
        items of an int list (``torch.randint(0, 10, (x.shape[0],))``) just to see whether
        they are ints, before the call reaches the tracer, which records it with the size
        still traced. Such a guard waits in ``pending_guards`` until the next traced event:
        the tracer's torch-call handler drops those its call's arguments explain, read at the
        instruction that makes the call (:meth:`drop_pending_guards`); anything else keeps
        them, so ``[0] * n`` just before ``torch.zeros(n)`` stays guarded.
        """
        node = proxy.node
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and convert is not python_len:  # len() reads the shape
            read = _VALUE_READS.get(convert)
            answered = NOT_ANSWERED if read is None else answer(self, proxy, read)
            if answered is not NOT_ANSWERED:  # frozen data, one sample per batch (value_reads)
                return answered
            error = user_error(
                TensorValueError,
                "Python control flow depends on the value of a tensor, which differs per "
                "batch and cannot be decided while tracing.",
                node=node,
                source=current_line(),
                fix=Fix(
                    "express it with tensor ops (torch.where, masking, clamp) or move it "
                    "into the data pipeline, before the step is called"
                ),
            )
            error.read_at = current_line()
            raise error
        if convert is int and type(value) is int:  # int(size): traced from now on (int_calls)
            INT_SITES.note(sys._getframe(2))  # the frame that called int()
        result = convert(value)
        frame = user_frame()
        guard = Guard(node, convert, result, frame_location(frame)[0])
        if isinstance(result, str) and not handed_out(node):  # an int site's text: read now
            self.texts.append(guard)
        elif pending:
            self.pending_guards.append((guard, _instruction(frame)))
        else:
            self.keep_pending_guards()
            self.guards.append(guard)
        return result

    def keep_pending_guards(self) -> None:  # pending __index__ guards were real Python ints
        self.guards.extend(guard for guard, _ in self.pending_guards)
        self.pending_guards.clear()

    def drop_pending_guards(self, args: Any) -> None:
        """Drop the parser's probes of this call: pending guards on proxies inside ``args``,
        read at the instruction that makes the call."""
        if not self.pending_guards:  # the usual case: no stack walk per traced call
            return
        nodes = {_node_if_created(leaf) for leaf in torch.utils._pytree.tree_leaves(args)}
        here = _instruction(user_frame())
        self.pending_guards[:] = [
            (guard, at)
            for guard, at in self.pending_guards
            if guard.node not in nodes or at != here
        ]

    def to_bool(self, obj: TracedValue) -> bool:
        return self.concrete(obj, bool)

    def iter(self, obj: TracedValue) -> Iterator[Any]:
        value, view = obj.node.meta.get("val"), dict_view_items(obj)
        if isinstance(value, dict) or view is not None:
            return iter(list(value.keys()) if view is None else view)
        length = self.concrete(obj, python_len)
        return iter([obj[index] for index in range(length)])

    def keys(self, obj: TracedValue) -> Any:
        value = obj.node.meta.get("val")
        return list(value.keys()) if hasattr(value, "keys") else super().keys(obj)


def _instruction(frame: FrameType | None) -> tuple[int, int]:
    """Which user frame, at which bytecode instruction (a call's probes share both)."""
    return (id(frame), frame.f_lasti) if frame is not None else (0, -1)


def _node_if_created(value: Any) -> fx.Node | None:
    """A proxy's node, without creating an attribute's node (that would be a traced event)."""
    if isinstance(value, TracedAttribute):
        return value._node
    return value.node if isinstance(value, fx.Proxy) else None


def _descriptive_name(kind: str, target: Any, args: tuple) -> str | None:
    """Names that read like the user's code: ``vae_encode``, ``latent_dist``, ``text_encoder_0``."""
    base = args[0] if args else None
    if not isinstance(base, fx.Node):
        return None
    held = base.meta.get("val")
    if kind == "call_method" and base.op == "get_attr" and isinstance(held, nn.Module):
        name = f"{base.name}_{target}"
    elif kind == "call_function" and target is getattr and len(args) > 1:
        name = f"{base.name}_{args[1]}" if base.op != "placeholder" else str(args[1])
    elif kind == "call_function" and target is operator.getitem and isinstance(args[1], (int, str)):
        name = f"{base.name}_{args[1]}"
    else:
        return None
    return name[-_MAX_NAME:].lstrip("_") or None


# -- entry point ----------------------------------------------------------------------------
def trace_step(
    model: nn.Module,
    example_values: dict[str, Any],
    leaf_names: frozenset[str],
    *,
    record: Callable[[fx.Node], bool] | None = None,
) -> Traced:
    """Trace ``model.forward`` into a graph whose nodes carry meta values.

    Must run inside :func:`graphsplit.planning.meta.analysis_view.analysis_view` (the model's
    tensors are meta). ``example_values`` maps each forward parameter name to its meta example
    value. Nodes that ``record`` accepts get ``node.meta["op_record"]`` for the analysis to reuse.
    """
    once = functools.partial(_trace_step_once, model, example_values, leaf_names, record)
    return INT_SITES.traced(once)


def _trace_step_once(
    model: nn.Module,
    example_values: dict[str, Any],
    leaf_names: frozenset[str],
    record: Callable[[fx.Node], bool] | None,
) -> Traced:
    states = generator_states()
    before = set(vars(model))
    retrace = functools.partial(_retrace, model, example_values, leaf_names)  # error path only
    try:
        with module_state_restored(model):
            tracer, graph = _trace_graph(model, example_values, leaf_names, record)
            constants = {
                name: vars(model)[name]
                for name in set(vars(model)) - before
                if isinstance(vars(model)[name], (torch.Tensor, torch.Generator))
            }
    except BaseException as failure:
        # Library code that drew from NumPy or Python and then fed the traced value to NumPy
        # (transformers' _compute_mask_indices) fails inside the trace: the draw is the cause.
        cause = isinstance(failure, Exception) and not isinstance(failure, GraphsplitError)
        if cause and changed_generators(states, generator_states()):
            raise random_draw_refusal(states, retrace) from failure
        set_generator_states(states)  # a failed trace must not move the user's generators
        raise
    if changed_generators(states, generator_states()):
        raise random_draw_refusal(states, retrace)
    check_autocast(graph)
    restore_input_names(graph, model)
    functionalize_inplace(graph)
    for guard in tracer.guards:  # for stage code to recheck (planning/rules/size_guards.py)
        guard.node.meta.setdefault(GUARDS, []).append(guard)
    input_names = tuple(n.target for n in graph.nodes if n.op == "placeholder")
    return Traced(graph, constants, tuple(tracer.guards), input_names)


def _retrace(model: nn.Module, example_values: dict[str, Any], leaf_names: frozenset) -> None:
    with module_state_restored(model):
        _trace_graph(model, example_values, leaf_names)


def _trace_graph(
    model: nn.Module,
    example_values: dict[str, Any],
    leaf_names: frozenset[str],
    record: Callable[[fx.Node], bool] | None = None,
) -> tuple[StepTracer, fx.Graph]:
    tracer = StepTracer(leaf_names, example_values)
    tracer.record = record
    tracer.forward_location = definition_of(type(model).forward)
    to_int = lambda size: tracer.concrete(size, operator.index)  # noqa: E731
    # Python conversions of traced values (__index__, range(), int() but of an int at an int
    # site: int_calls.py) are guarded ints; one that depends on the batch size is refused by
    # the analysis (analyze._check_guards).
    # Everything the trace changes in the process goes through one patcher, undone when the
    # block ends however it ends; a trace in another thread waits for this one (patcher.py).
    with Patcher() as patcher:
        INT_SITES.rebind(patcher)
        record_leaf_methods(patcher, tracer, model, leaf_names)
        replace_range(patcher, to_int)
        accept_traced_sizes(patcher)
        record_torch_calls(patcher, tracer)
        record_checkpoints(patcher, tracer)
        record_autograd_functions(patcher, tracer)
        record_einops_calls(patcher, tracer)
        record_legacy_constructor(patcher, tracer)
        assume_tensor_checks(patcher)
        replace_python_builtins(patcher, (TracedValue, TracedAttribute))
        tracer.module_writes = record_module_writes(patcher, tracer, model)
        try:
            graph = tracer.trace(model, concrete_args=defaults_not_given(model, example_values))
        except KeyError as error:
            refuse_a_size_as_key(error)
            raise
        except TypeError as error:
            refuse_traced_text(error, example_values)
            raise
    tracer.keep_pending_guards()
    return tracer, graph
