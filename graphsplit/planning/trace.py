"""Trace a training step into a torch.fx graph at the level of the user's code.

Glossary:
    leaf module: a submodule recorded as one ``call_module`` node instead of being traced into.
        Modules whose parameters are all frozen or all trainable are leaves (so stage 2 calls
        the user's own trainable modules: their forward, hooks and checkpointing stay theirs).
        Modules that mix both are traced into when :func:`trace_step` is asked to.
    leaf method call: ``vae.encode(x)`` on a leaf module, recorded as ``get_attr(vae)`` followed
        by ``call_method(encode)``, just like ``forward``.
    meta value: every node carries ``node.meta["val"]``, the value its op produced on ``meta``
        tensors. Python control flow on shapes, ranks, dtypes and devices reads these values;
        control flow on tensor *values* raises :class:`~graphsplit.errors.TraceError`.
    guard: a Python value the trace read from a meta value (a ``len``, ``bool``, ``int``), kept
        so the analysis can check it does not change with the batch size.

In: the model, example inputs as meta values, the names of modules to trace into.
Out: :class:`Traced` — the graph, the constants it references, and its guards.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import operator
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

import torch
import torch.fx as fx
import torch.utils._device
from torch import nn

from graphsplit.errors import GraphsplitError, TraceError, user_error
from graphsplit.planning.meta import meta_execution, to_meta
from graphsplit.planning.source import (
    current_source,
    frame_location,
    frame_location_of,
    is_internal,
)
from graphsplit.runtime import functional_setitem

_MAX_NAME = 48
_STATIC_TENSOR_ATTRIBUTES = frozenset({"dtype", "is_floating_point", "is_complex"})


@dataclass(frozen=True)
class Guard:
    """A Python value the traced code derived from a meta value, e.g. ``len(x.shape)``."""

    node: fx.Node
    convert: Callable[[Any], Any]
    value: Any
    source: str


@dataclass
class Traced:
    """The traced step: ``graph`` references the model's attributes and ``constants`` by name."""

    graph: fx.Graph
    constants: dict[str, torch.Tensor]
    guards: list[Guard]
    input_names: tuple[str, ...]
    notes: list[str] = field(default_factory=list)


def fetch(model: nn.Module, constants: dict[str, Any], target: str) -> Any:
    """The object a ``get_attr`` / ``call_module`` target names."""
    if target in constants:
        return constants[target]
    value: Any = model
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def execute(
    model: nn.Module, constants: dict[str, Any], node: fx.Node, args: tuple, kwargs: dict
) -> Any:
    """Run one node's op on already-evaluated ``args``/``kwargs`` (the caller picks the device)."""
    if node.op == "get_attr":
        return to_meta(fetch(model, constants, node.target))
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    if node.op == "call_module":
        return model.get_submodule(node.target)(*args, **kwargs)
    raise AssertionError(f"execute() does not run {node.op} nodes")


class _Proxy(fx.Proxy):
    """A proxy whose Python conversions (``len``, ``bool``, ``int``) read the meta value."""

    def __getattr__(self, name: str) -> Any:
        if name in _STATIC_TENSOR_ATTRIBUTES:
            value = self.node.meta.get("val")
            if isinstance(value, torch.Tensor):
                # A traced op's dtype is fixed by the trace; code such as torch.finfo(x.dtype)
                # needs the real object. (Under autocast, split with the same autocast on.)
                return getattr(value, name)
        return _Attribute(self, name)

    def __len__(self) -> int:
        return self.tracer.concrete(self, len)

    def __int__(self) -> int:
        return self.tracer.concrete(self, int)

    def __float__(self) -> float:
        return self.tracer.concrete(self, float)

    def __iter__(self) -> Iterator[Any]:
        return self.tracer.iter(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        # Recorded in place, then rewritten as a copy by _functionalize_setitem.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class _Attribute(_Proxy):
    """``proxy.name``: a method call if called, else a lazily created ``getattr`` node."""

    def __init__(self, root: _Proxy, attr: str) -> None:
        self.root = root
        self.attr = attr
        self.tracer = root.tracer
        self._node: fx.Node | None = None

    @property
    def node(self) -> fx.Node:  # type: ignore[override]
        if self._node is None:
            self._node = self.tracer.create_proxy(
                "call_function", getattr, (self.root, self.attr), {}
            ).node
        return self._node

    def __call__(self, *args: Any, **kwargs: Any) -> _Proxy:
        return self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs)


class _Tracer(fx.Tracer):
    """fx tracer whose proxies carry meta values and whose leaves include method calls."""

    def __init__(self, leaf_names: frozenset[str], example_values: dict[str, Any]) -> None:
        super().__init__(autowrap_modules=(math,), param_shapes_constant=False)
        self.leaf_names = leaf_names
        self.example_values = example_values
        self.guards: list[Guard] = []
        self.computing_meta = False
        self.module_proxies: dict[str, _Proxy] = {}
        self.forward_location: tuple[str, str] = ("<unknown>", "")
        # Wraps each op's meta execution; the analysis records ATen ops here once, so its
        # first probe run can reuse the trace instead of running the model again.
        self.observe: Callable[[fx.Node, Callable[[], Any]], Any] | None = None

    # -- graph construction -------------------------------------------------------------
    def proxy(self, node: fx.Node) -> _Proxy:
        return _Proxy(node, self)

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.leaf_names or super().is_leaf_module(module, qualified_name)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if name is None:
            name = _descriptive_name(kind, target, args)
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "placeholder":
            node.meta["source"], node.meta["source_code"] = self.forward_location
            node.meta["val"] = self._meta_value(node)
        elif kind != "output":
            node.meta["source"], node.meta["source_code"] = current_source()
            node.meta["val"] = self._meta_value(node)
        return node

    def call_module(self, module, forward, args, kwargs):
        if self.computing_meta:
            return forward(*args, **kwargs)
        return super().call_module(module, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.computing_meta:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def module_proxy(self, qualified_name: str) -> _Proxy:
        """One ``get_attr`` node per leaf module whose methods the step calls."""
        if qualified_name not in self.module_proxies:
            self.module_proxies[qualified_name] = self.create_proxy(
                "get_attr", qualified_name, (), {}
            )
        return self.module_proxies[qualified_name]

    # -- meta values ----------------------------------------------------------------------
    def _meta_value(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return self.example_values.get(node.target)
        args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
        self.computing_meta = True
        try:
            with meta_execution():
                if self.observe is None:
                    return execute(self.root, {}, node, args, kwargs)
                return self.observe(node, lambda: execute(self.root, {}, node, args, kwargs))
        except GraphsplitError:
            raise
        except Exception as exc:
            raise meta_failure(node, exc) from exc
        finally:
            self.computing_meta = False

    # -- Python conversions of traced values ---------------------------------------------
    def concrete(self, proxy: _Proxy, convert: Callable[[Any], Any]) -> Any:
        """Resolve a Python conversion from the meta value; refuse it on tensor data."""
        node = proxy.node
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and convert is not len:  # len() reads the shape
            raise user_error(
                TraceError,
                "Python control flow depends on the value of a tensor, which differs per "
                "batch and cannot be decided while tracing.",
                node=node,
                source=_source_here(),
                fix="express it with tensor ops (torch.where, masking, clamp) or move it "
                "into the data pipeline, before the step is called",
            )
        result = convert(value)
        location, _ = current_source()
        self.guards.append(Guard(node, convert, result, location))
        return result

    def to_bool(self, obj: _Proxy) -> bool:
        return self.concrete(obj, bool)

    def iter(self, obj: _Proxy) -> Iterator[Any]:
        value = obj.node.meta.get("val")
        if isinstance(value, dict):
            return iter(list(value.keys()))
        length = self.concrete(obj, len)
        return iter([obj[index] for index in range(length)])

    def keys(self, obj: _Proxy) -> Any:
        value = obj.node.meta.get("val")
        if hasattr(value, "keys"):
            return list(value.keys())
        return super().keys(obj)


def _source_here() -> str:
    location, code = current_source()
    return f"{location}  {code}" if code else location


def meta_failure(node: fx.Node, exc: Exception) -> TraceError:
    """A TraceError for an op that failed on meta tensors, the usual cause spelled out."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _is_data_dependent(message):
        return user_error(
            TraceError,
            f"The step reads the value of a tensor ({message}); graphsplit decides the split "
            "without real data, so values cannot steer the step.",
            node=node,
            fix="replace .item()/.tolist()/nonzero-style code with tensor ops (torch.where, "
            "masking), or move it into the data pipeline",
        )
    return user_error(
        TraceError,
        f"Running this operation on meta tensors failed: {type(exc).__name__}: {message}",
        node=node,
        fix="make the step device-agnostic (take devices from input tensors, avoid .cpu()/"
        ".numpy()); if the failure is inside a library module, report it with this message",
    )


def _is_data_dependent(message: str) -> bool:
    markers = ("meta tensor", "_local_scalar_dense", "data-dependent", "item()", "tolist")
    return any(marker in message for marker in markers)


def _descriptive_name(kind: str, target: Any, args: tuple) -> str | None:
    """Names that read like the user's code: ``vae_encode``, ``latent_dist``, ``text_encoder_0``."""
    base = args[0] if args else None
    if not isinstance(base, fx.Node):
        return None
    if (
        kind == "call_method"
        and base.op == "get_attr"
        and isinstance(base.meta.get("val"), nn.Module)
    ):
        name = f"{base.name}_{target}"
    elif kind == "call_function" and target is getattr and len(args) > 1:
        name = f"{base.name}_{args[1]}" if base.op != "placeholder" else str(args[1])
    elif kind == "call_function" and target is operator.getitem and isinstance(args[1], (int, str)):
        name = f"{base.name}_{args[1]}"
    else:
        return None
    return name[-_MAX_NAME:].lstrip("_") or None


# -- leaf method interception ------------------------------------------------------------------
def _public_methods(module: nn.Module) -> list[str]:
    names: list[str] = []
    for klass in type(module).__mro__:
        if klass in (nn.Module, object):
            break
        for name, attr in vars(klass).items():
            if isinstance(attr, FunctionType) and not name.startswith("_") and name not in names:
                names.append(name)
    return names


def _contains_proxy(tree: Any) -> bool:
    return any(isinstance(leaf, fx.Proxy) for leaf in torch.utils._pytree.tree_leaves(tree))


def _intercept_methods(tracer: _Tracer, model: nn.Module, leaf_names: frozenset[str]) -> list:
    """Record method calls on leaf modules (``vae.encode(x)``) as single nodes."""
    patched = []
    for qualified_name in sorted(leaf_names):
        module = model.get_submodule(qualified_name)
        for method_name in _public_methods(module):
            original = getattr(module, method_name)

            def recorded(
                *args, __name=qualified_name, __method=method_name, __orig=original, **kwargs
            ):
                if tracer.computing_meta or not _contains_proxy((args, kwargs)):
                    return __orig(*args, **kwargs)
                handle = tracer.module_proxy(__name)
                return tracer.create_proxy("call_method", __method, (handle, *args), kwargs)

            had = method_name in vars(module)
            previous = vars(module).get(method_name)
            object.__setattr__(module, method_name, recorded)
            patched.append((module, method_name, had, previous))
    return patched


def _restore_methods(patched: list) -> None:
    for module, method_name, had, previous in reversed(patched):
        if had:
            object.__setattr__(module, method_name, previous)
        else:
            vars(module).pop(method_name, None)


# -- randomness drawn while tracing ------------------------------------------------------------
def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy.random"] = numpy.random.get_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy.random" in states:
        numpy.random.set_state(states["numpy.random"])


def _locate_random_draw(run: Callable[[], Any]) -> str | None:
    """Rerun ``run`` line by line; return the first user line after which a generator moved.

    Only called once a draw is known to have happened, so its cost (a trace function on every
    user-code line) is paid on the error path alone.
    """
    found: list[str] = []
    state = [_rng_states()]
    last_line: list[str] = []

    def local(frame, event, arg):
        if found:
            return None
        if event in ("line", "return"):
            current = _rng_states()
            if last_line and _changed_generators(state[0], current):
                found.append(last_line[0])
                return None
            state[0] = current
            location, code = frame_location(frame)
            last_line[:] = [f"{location}  {code}" if code else location]
        return local

    def global_trace(frame, event, arg):
        if found or is_internal(frame.f_code.co_filename):
            return None
        return local

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        run()
    except Exception:  # the first trace succeeded; a failure here only loses the location
        pass
    finally:
        sys.settrace(previous)
    return found[0] if found else None


def _changed_generators(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changed = []
    for name, state in before.items():
        other = after[name]
        if name == "torch":
            same = torch.equal(state, other)
        elif name == "random":
            same = state == other
        else:  # numpy: (name, keys array, position, has_gauss, cached_gaussian)
            same = bool((state[1] == other[1]).all()) and state[2:] == other[2:]
        if not same:
            changed.append(name)
    return changed


# -- entry point ----------------------------------------------------------------------------
def trace_step(
    model: nn.Module,
    example_values: dict[str, Any],
    leaf_names: frozenset[str],
    observe: Callable[[fx.Node, Callable[[], Any]], Any] | None = None,
) -> Traced:
    """Trace ``model.forward`` into a graph whose proxies carry meta values.

    Must run inside :func:`graphsplit.planning.meta.analysis_view` (the model's tensors are meta).
    ``example_values`` maps each forward parameter name to its meta example value.
    """
    states = _rng_states()
    before = set(vars(model))
    tracer, graph = _trace_graph(model, example_values, leaf_names, observe)
    changed = _changed_generators(states, _rng_states())
    if changed:
        _set_rng_states(states)  # the user's generators must not move because we traced
        location = _locate_random_draw(lambda: _trace_graph(model, example_values, leaf_names))
        _set_rng_states(states)
        raise user_error(
            TraceError,
            f"Random numbers were drawn while tracing ({', '.join(changed)} generator); the "
            "draw would be frozen into the plan instead of happening every step.",
            source=location,
            fix="draw randomness with torch ops that take a traced tensor (torch.randn_like(x),"
            " torch.randint(..., device=x.device)); move Python/NumPy randomness into the data "
            "pipeline and pass the result as an input",
        )
    constants = {
        name: vars(model)[name]
        for name in set(vars(model)) - before
        if isinstance(vars(model)[name], torch.Tensor)
    }
    _restore_input_names(graph, model)
    _functionalize_setitem(graph)
    input_names = tuple(n.target for n in graph.nodes if n.op == "placeholder")
    return Traced(graph, constants, tracer.guards, input_names)


def _trace_graph(
    model: nn.Module,
    example_values: dict[str, Any],
    leaf_names: frozenset[str],
    observe: Callable[[fx.Node, Callable[[], Any]], Any] | None = None,
) -> tuple[_Tracer, fx.Graph]:
    tracer = _Tracer(leaf_names, example_values)
    tracer.observe = observe
    tracer.forward_location = _definition_of(type(model).forward)
    patched = _intercept_methods(tracer, model, leaf_names)
    try:
        with _traced_range(tracer), _traced_factories():
            graph = tracer.trace(model, concrete_args=_concrete_args(model, example_values))
    except TypeError as exc:
        if "Proxy' object cannot be interpreted as an integer" not in str(exc):
            raise
        raise user_error(
            TraceError,
            "Python code uses a traced size as a Python integer (range(), a list index, a "
            "slice bound); such a size may depend on the batch size, so it cannot become a "
            "Python number in a plan that must work for every batch.",
            source=_innermost_user_line(exc),
            fix="use tensor ops over the whole batch (no Python loop over samples), or read "
            "fixed sizes (not the batch size) from the model's config",
        ) from None
    finally:
        _restore_methods(patched)
    return tracer, graph


class _RangeType(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _BUILTIN_RANGE)


_BUILTIN_RANGE = range


_SIZE_VARARG_FACTORIES = ("zeros", "ones", "empty", "rand", "randn")


def _packing_sizes(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.zeros(h, w, 3)`` with traced ``h``/``w``: torch's parser takes them as a tuple."""

    def factory_with_traced_sizes(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(arg, fx.Proxy) for arg in args) and all(
            isinstance(arg, (int, fx.Proxy)) for arg in args
        ):
            return factory(tuple(args), **kwargs)
        return factory(*args, **kwargs)

    return factory_with_traced_sizes


@contextlib.contextmanager
def _traced_factories() -> Iterator[None]:
    # torch.device(...) as a context manager caches the set of factory functions it redirects
    # on first use; fill that cache with the real functions before they are wrapped.
    device_constructors = getattr(torch.utils._device, "_device_constructors", None)
    if device_constructors is not None:
        device_constructors()
    originals = {name: getattr(torch, name) for name in _SIZE_VARARG_FACTORIES}
    for name, factory in originals.items():
        setattr(torch, name, _packing_sizes(factory))
    try:
        yield
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)


@contextlib.contextmanager
def _traced_range(tracer: _Tracer) -> Iterator[None]:
    """``range(x.shape[1])`` works while tracing: traced sizes become guarded Python ints."""

    class TracedRange(metaclass=_RangeType):
        def __new__(cls, *args: Any) -> range:
            args = tuple(
                tracer.concrete(arg, operator.index) if isinstance(arg, fx.Proxy) else arg
                for arg in args
            )
            return _BUILTIN_RANGE(*args)

    builtins.range = TracedRange
    try:
        yield
    finally:
        builtins.range = _BUILTIN_RANGE


def _innermost_user_line(exc: BaseException) -> str | None:
    """The last user-code line in ``exc``'s traceback, as ``file:line  code``."""
    found = None
    trace = exc.__traceback__
    while trace is not None:
        if not is_internal(trace.tb_frame.f_code.co_filename):
            location, code = frame_location_of(trace.tb_frame.f_code.co_filename, trace.tb_lineno)
            found = f"{location}  {code}" if code else location
        trace = trace.tb_next
    return found


def _definition_of(function: Any) -> tuple[str, str]:
    """``("file:line", "def forward(...)")`` of the step's forward: where inputs come from."""
    import inspect

    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return "<unknown>", ""
    location, text = frame_location_of(code.co_filename, code.co_firstlineno)
    return location, text


_VIEW_METHODS = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "permute",
        "expand",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "narrow",
        "select",
        "unbind",
        "split",
        "chunk",
        "t",
        "view_as",
        "as_strided",
        "diagonal",
        "movedim",
        "swapaxes",
        "unfold",
    }
)


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        return isinstance(node.meta.get("val"), torch.Tensor)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name in _VIEW_METHODS


def _functionalize_setitem(graph: fx.Graph) -> None:
    """Rewrite ``x[k] = v`` as ``x2 = functional_setitem(x, k, v)``; later reads use ``x2``.

    The cut and the stages then see plain dataflow. Assignments into a view would also change
    its base tensor, which dataflow cannot express, so they are refused.
    """
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is operator.setitem):
            continue
        target = node.args[0]
        producers = ("call_function", "call_method", "call_module")
        if not isinstance(target, fx.Node) or _is_view(target) or target.op not in producers:
            raise user_error(
                TraceError,
                "The step assigns into a slice of a tensor view or input (x[...] = value); "
                "graphsplit traces dataflow and cannot follow the write into the tensor it "
                "views.",
                node=node,
                fix="build the tensor with torch.where / torch.cat / torch.stack, or assign "
                "into a fresh tensor created in the step (torch.zeros(...)) rather than a view",
            )
        with graph.inserting_before(node):
            updated = graph.call_function(functional_setitem, node.args)
        # Keep the source line; drop what the in-place op recorded (the copy runs other ops).
        updated.meta = {
            key: node.meta[key] for key in ("source", "source_code") if key in node.meta
        }
        updated.meta["val"] = target.meta.get("val")
        later = [user for user in target.users if order.get(user, -1) > order[node]]
        for user in later:
            user.replace_input_with(target, updated)
        graph.erase_node(node)


def _restore_input_names(graph: fx.Graph, model: nn.Module) -> None:
    """fx renames parameters it received as concrete args (``weight`` -> ``weight_1``)."""
    import inspect

    names = list(inspect.signature(model.forward).parameters)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        if node.target != name:
            node.target = name


def _concrete_args(model: nn.Module, example_values: dict[str, Any]) -> dict[str, Any] | None:
    """Parameters of ``forward`` the caller did not pass keep their defaults as constants."""
    import inspect

    signature = inspect.signature(model.forward)
    missing = {
        name: parameter.default
        for name, parameter in signature.parameters.items()
        if name not in example_values
        and parameter.default is not inspect.Parameter.empty
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    return missing or None
