"""Frozen value-dependent code as one opaque stage-1 step: find it, record it, check it.

Glossary:
    value read: the trace failed with :class:`~graphsplit.errors.TensorValueError`: code read
        a tensor's value (``for v in seq_lens: x[:, v:] = 0``, ``.tolist()``, ``x[mask]``).
    opaque site: the innermost function of user or library code (not torch's, graphsplit's or
        the standard library's; not a comprehension or lambda; not the step's own ``forward``)
        that was running when the value was read, and where it is looked up: a class attribute
        (methods, static and class methods) or a module global (:class:`OpaqueSite`). The
        retrace patches it there, so every call of it with traced arguments becomes one node
        (:class:`~graphsplit.planning.rules.opaque_call.OpaqueCall`). If the trace still fails in
        its caller (the caller reads values the function returned), the caller is next.
    example run: the opaque call is run for real on the example batch, with the model's real
        frozen weights put back for the run (:mod:`~graphsplit.planning.opaque.example_run`); its
        inputs are computed for real from the example batch by the graph traced so far. The
        output's shapes and dtypes are the node's meta value. It is refused when its inputs
        depend on a trainable parameter or a random draw, when it reads a trainable parameter,
        a frozen weight or an input on ``meta``, draws random numbers (the user's generators
        are restored either way), writes into its inputs or the model's tensors, or returns
        anything but tensors (the caller is tried).
    per-sample check: with a batch of several samples, the call is also run on each sample
        alone; each output must equal the samples' outputs stacked along one dim, bit for bit
        (that dim is its batch dim), or be the same for every sample. Otherwise it mixes
        samples (padding to the batch's longest prompt, a list of one item per sample) and its
        caller is tried; when no caller is left it is refused: plan at batch 1.

The example run itself lives in :mod:`graphsplit.planning.opaque.example_run`, what a site is
(:class:`OpaqueSite`, :data:`VALUE_FIX`) in :mod:`graphsplit.planning.opaque.site_types`.

In: the exception of a failed trace; the traced graph after the analysis. Out:

    site_of_failure(exc, known, root) -> OpaqueSite | None
    opaque_calls_recorded(sites, run) -> context manager   # patches each site for one trace
    check_opaque_nodes(graph, trainable)                   # after the analysis: never tainted
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from types import FrameType, FunctionType, ModuleType, TracebackType
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from graphsplit.errors import TraceError, user_error
from graphsplit.planning.meta.meta_interpreter import is_meta_run
from graphsplit.planning.opaque.example_run import ExampleRun
from graphsplit.planning.opaque.site_types import VALUE_FIX, OpaqueSite
from graphsplit.planning.rules.opaque_call import OPAQUE, is_opaque
from graphsplit.planning.rules.taint import compute_taint
from graphsplit.planning.rules.user_lines import describe, frame_location_of, is_internal


# -- where the value was read -------------------------------------------------------------------
def site_of_failure(
    exc: BaseException, known: list[OpaqueSite], root: nn.Module, trainable: frozenset[str]
) -> OpaqueSite | None:
    """The innermost patchable function of user code running when ``exc`` was raised.

    Frames come from the exception's traceback, innermost first; sites already opaque are
    passed over (the failure is then in a caller), and the step's own ``forward`` (the
    outermost user frame) is never opaque: value reads there stay the user's error. A value
    read inside a leaf module's meta run (its code is run for its value, not traced) makes
    that call the candidate, when the module is frozen: its method (``forward``,
    ``encode``) is patched on its class and the module is traced as a call. A mixed leaf
    (frozen and trainable parameters) is only traced into: the read is in its frozen half or
    its trainable one, which the next trace tells.
    """
    frames: list[tuple[FrameType, int]] = []  # user frames of traced code
    meta_run: FrameType | None = None  # the frame running a leaf node on meta, if any
    read_at = None  # the innermost user line under it
    # The meta run re-raises what failed under it (``raise ... from exc``): the frames of the
    # module's own code are in the cause's traceback.
    below = exc.__cause__.__traceback__ if exc.__cause__ is not None else None
    for frame, line in [*_frames(exc.__traceback__), *_frames(below)]:
        if meta_run is None and is_meta_run(frame.f_code):
            meta_run = frame
        elif meta_run is None and _is_user(frame):
            frames.append((frame, line))
        elif meta_run is not None and _is_user(frame):
            read_at = describe(frame_location_of(frame.f_code.co_filename, line))
    # Each function's caller is the frame before it: where the call looked its name up.
    called = list(enumerate(frames))[1:]
    candidates = [
        _site_of(frame, line, frames[index - 1][0]) for index, (frame, line) in reversed(called)
    ]
    node = meta_run.f_locals.get("node") if meta_run is not None else None
    if isinstance(node, fx.Node) and read_at is not None:
        candidates.insert(0, _leaf_site(node, read_at, root, trainable))
    for site in candidates:
        if site is not None and not any(site.same(other) for other in known):
            return site
    return None


def read_in_step_body(exc: BaseException) -> bool:
    """Whether the value read that raised ``exc`` is in the step's own code (its ``forward``,
    or the function given to ``split``): the outermost user frame, which is never opaque and
    whose reads are not answered either: the user can write them with tensor ops."""
    below = exc.__cause__.__traceback__ if exc.__cause__ is not None else None
    frames = [frame for frame, _ in [*_frames(exc.__traceback__), *_frames(below)]]
    user = [frame for frame in frames if _is_user(frame) and not is_meta_run(frame.f_code)]
    return len(user) <= 1


def _leaf_site(
    node: fx.Node, read_at: str, root: nn.Module, trainable: frozenset[str]
) -> OpaqueSite | None:
    """The method of a frozen leaf module a ``call_module`` / leaf ``call_method`` node ran."""
    if node.op == "call_module":
        name, method = str(node.target), "forward"
    elif node.op == "call_method" and node.args and getattr(node.args[0], "op", "") == "get_attr":
        name, method = str(node.args[0].target), str(node.target)
    else:
        return None
    try:
        module = root.get_submodule(name)
    except AttributeError:
        return None
    trains = {f"{name}.{param}" in trainable for param, _ in module.named_parameters()}
    if trains == {True}:
        return None  # a trainable module runs in stage 2: the value read stays an error
    for owner in type(module).__mro__:
        if method in vars(owner) and _code_of(vars(owner)[method]) is not None:
            return OpaqueSite(owner, method, read_at, leaf=name, trace_into=True in trains)
    return None


def _frames(traceback: TracebackType | None) -> Iterator[tuple[FrameType, int]]:
    while traceback is not None:
        yield traceback.tb_frame, traceback.tb_lineno
        traceback = traceback.tb_next


def _is_user(frame: FrameType) -> bool:
    return not is_internal(frame.f_code.co_filename)


def _site_of(frame: FrameType, line: int, caller: FrameType) -> OpaqueSite | None:
    """Where the function running in ``frame`` is looked up, if it is a class's or module's;
    with the names ``caller``'s module imported it under (``from x import f``)."""
    code = frame.f_code
    if code.co_name.startswith("<"):  # a comprehension, lambda or module body: not callable
        return None
    read_at = describe(frame_location_of(code.co_filename, line))
    owners: list[type | ModuleType] = []
    if code.co_argcount and code.co_varnames[0] in frame.f_locals:
        first = frame.f_locals[code.co_varnames[0]]
        owners += list((first if isinstance(first, type) else type(first)).__mro__)
    module = sys.modules.get(frame.f_globals.get("__name__", ""))
    if module is not None:
        owners.append(module)
        owners += [value for value in vars(module).values() if isinstance(value, type)]
    for owner in owners:
        for attribute, value in list(vars(owner).items()):
            if _code_of(value) is code:
                return OpaqueSite(owner, attribute, read_at, aliases=_aliases(code, caller, owner))
    return None


def _aliases(code: Any, caller: FrameType, owner: Any) -> tuple[tuple[ModuleType, str], ...]:
    """The caller module's globals that are the function too (``from x import f`` binds the
    name there, and the call looks it up there)."""
    module = sys.modules.get(caller.f_globals.get("__name__", ""))
    if module is None or module is owner:
        return ()
    return tuple(
        (module, name)
        for name, value in list(vars(module).items())
        if isinstance(value, FunctionType) and _code_of(value) is code
    )


def _code_of(value: Any) -> Any:
    function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function.__code__ if isinstance(function, FunctionType) else None


# -- recording the calls ------------------------------------------------------------------------
@contextlib.contextmanager
def opaque_calls_recorded(sites: list[OpaqueSite], run: ExampleRun) -> Iterator[None]:
    """Patch each site so a call with traced arguments is one node; undone on exit.

    A module function is also patched where the model's objects hold it as an instance
    attribute (DiffSynth's ``pipe.model_fn = model_fn_wan_video``): the call looks it up there,
    not in its module.
    """
    patched: list[tuple[Any, str, Any]] = []
    for site in sites:
        if site.trace_into:  # a mixed module: traced into, nothing recorded as one node
            continue
        raw = site.raw
        recording = _recording_descriptor(site, raw, run)
        patched.append((site.owner, site.attribute, raw))
        setattr(site.owner, site.attribute, recording)
        if isinstance(site.owner, ModuleType):
            holders = [*site.aliases, *_instances_holding(run.model, raw)]
            for holder, attribute in holders:
                held = vars(holder)[attribute]
                patched.append((holder, attribute, held))
                same = held is raw
                setattr(holder, attribute, recording if same else _recording(site, held, run))
    try:
        yield
    finally:
        for owner, attribute, raw in reversed(patched):
            setattr(owner, attribute, raw)


def _instances_holding(model: nn.Module, function: Any) -> list[tuple[Any, str]]:
    """``(object, attribute)`` for each instance attribute of the model's modules, and of the
    objects they hold (a pipeline that is not a module), that is ``function`` itself."""
    found, seen = [], set()
    holders: list[Any] = list(model.modules())
    holders += [
        value
        for module in list(holders)
        for value in vars(module).values()
        if hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type, FunctionType))
    ]
    for holder in holders:
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        for attribute, value in list(vars(holder).items()):
            if value is function:
                found.append((holder, attribute))
    return found


def _recording_descriptor(site: OpaqueSite, raw: Any, run: ExampleRun) -> Any:
    if isinstance(raw, (staticmethod, classmethod)):
        return type(raw)(_recording(site, raw.__func__, run))
    return _recording(site, raw, run)


def _recording(site: OpaqueSite, function: Callable[..., Any], run: ExampleRun) -> Any:
    @functools.wraps(function)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracer_of((args, kwargs))
        if tracer is None or tracer.computing_meta:  # no traced value, or a real run
            return function(*args, **kwargs)
        return run.record(site, function, tracer, args, kwargs)

    return recorded


def _tracer_of(tree: Any) -> Any:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, fx.Proxy):
            return leaf.tracer
    return None


# -- after the analysis -------------------------------------------------------------------------
def check_opaque_nodes(graph: fx.Graph, trainable: frozenset[str]) -> None:
    """Refuse an opaque call that the analysis found tainted (it would have to run in stage 2)."""
    taint = compute_taint(graph, trainable)
    for node in graph.nodes:
        if is_opaque(node) and node in taint:
            facts = node.meta[OPAQUE]
            raise user_error(
                TraceError,
                f"{facts.label} reads tensor values, so it can only run eagerly in stage 1, but "
                f"its value must be computed every step ({taint[node].reason}).",
                node=node,
                source=facts.read_at,
                fix=VALUE_FIX,
            )
