"""Python-level patches active only while a step is traced, each undone on exit.

Glossary:
    leaf method call: ``vae.encode(x)`` on a leaf module, recorded as one ``call_method`` node
        on a ``get_attr(vae)`` handle, just like ``forward`` (:func:`leaf_methods_recorded`).
    traced range: ``range(x.shape[1])`` with a traced size; the size becomes a guarded Python
        int read from the meta value (:func:`traced_range`).
    size-vararg factory: ``torch.zeros(h, w, 3)`` with traced ``h``/``w``; torch's argument
        parser only takes them as one tuple (:func:`traced_factories`).
    traced torch call: a torch call with no traced argument that still becomes a node: every
        random draw, and a real tensor indexed by a traced value (:func:`traced_torch_calls`).
    einops call: ``rearrange`` / ``repeat`` on traced values, one node each
        (:func:`einops_calls_recorded`).
    assumed check: ``torch._check(cond)`` / ``torch._check_tensor_all_with(error, cond,
        message)`` on a traced condition, taken to hold (:func:`tensor_checks_assumed`).
    legacy constructor: ``torch.Tensor(data)`` / ``torch.Tensor(*sizes)``, which torch runs
        without consulting ``__torch_function__``; with a traced argument it is one node
        (:func:`legacy_constructor_recorded`).
    checkpoint region: the nodes traced inside one ``torch.utils.checkpoint.checkpoint(fn,
        ...)`` call, tagged ``node.meta["checkpoint"]`` (:func:`checkpoints_recorded`), so
        stage 2 can checkpoint them again (:mod:`graphsplit.planning.rules.checkpoint`).

In: the tracer (for :func:`leaf_methods_recorded`), or a function turning a traced size into a
Python int (for :func:`traced_range`). Out: context managers.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import operator
import sys
from collections.abc import Callable, Iterator
from types import FunctionType, MethodType
from typing import Any

import torch
import torch.fx as fx
import torch.utils._device
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode

from graphsplit.runtime import functional_inplace


# -- leaf method calls ------------------------------------------------------------------------
def _public_methods(cls: type) -> tuple[str, ...]:
    """Methods defined by ``cls`` and its bases up to ``nn.Module``."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for name, attr in vars(klass).items():
            if isinstance(attr, FunctionType) and not name.startswith("_") and name not in names:
                names.append(name)
    return tuple(names)


def _contains_proxy(tree: Any) -> bool:
    """Whether a traced value is anywhere in ``tree`` (its pytree leaves).

    Asked for every leaf-module call and every torch call the tracer sees, so plain tuples,
    lists and dicts are walked directly and Python's own ``isinstance`` is used (the trace's
    stand-in answers for proxies, which this test is about); other containers go through
    pytree.
    """
    kind = type(tree)
    if kind is tuple or kind is list:
        return any(map(_contains_proxy, tree))
    if kind is dict:
        return any(map(_contains_proxy, tree.values()))
    if kind in _NO_PROXY_INSIDE:
        return False
    if _PYTHON_ISINSTANCE(tree, fx.Proxy):
        return True
    return any(_PYTHON_ISINSTANCE(leaf, fx.Proxy) for leaf in torch.utils._pytree.tree_leaves(tree))


# Leaves that hold no traced value; bound at import, before a trace replaces isinstance.
_NO_PROXY_INSIDE = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size, torch.Tensor}
)
_PYTHON_ISINSTANCE = isinstance


@contextlib.contextmanager
def leaf_methods_recorded(
    tracer: Any, model: nn.Module, leaf_names: frozenset[str]
) -> Iterator[None]:
    """Record method calls on leaf modules (``vae.encode(x)``) as single nodes.

    ``tracer`` is the step's tracer: ``tracer.computing_meta`` is true while it runs an op for
    its meta value (the real method must run then), ``tracer.module_proxy(name)`` gives the
    module's ``get_attr`` handle.
    """
    patched = []
    methods_of: dict[type, tuple[str, ...]] = {}  # a big model has thousands of leaves, few types
    flags_of: dict[int, frozenset[bool]] = {}  # one walk of the tree for every leaf's flags
    submodules: dict[str, nn.Module] = {"": model}
    for qualified_name in sorted(leaf_names):
        module = _submodule(submodules, qualified_name)
        if type(module) not in methods_of:
            methods_of[type(module)] = _public_methods(type(module))
        inline = _requires_grad_flags(module, flags_of) == {True, False}
        for method_name in methods_of[type(module)]:
            original = getattr(module, method_name)
            recorded = _recording(tracer, qualified_name, method_name, original, inline=inline)
            had = method_name in vars(module)
            previous = vars(module).get(method_name)
            object.__setattr__(module, method_name, recorded)
            patched.append((module, method_name, had, previous))
    try:
        yield
    finally:
        for module, method_name, had, previous in reversed(patched):
            if had:
                object.__setattr__(module, method_name, previous)
            else:
                vars(module).pop(method_name, None)


def _submodule(known: dict[str, nn.Module], qualified_name: str) -> nn.Module:
    """``model.get_submodule(qualified_name)``, one step from its memoised parent.

    ``known`` maps dotted names already resolved to their modules (``""`` is the model), so
    thousands of leaves sharing their parents cost one attribute step each instead of a walk
    from the root each.
    """
    module = known.get(qualified_name)
    if module is None:
        parent, _, last = qualified_name.rpartition(".")
        module = known[qualified_name] = _submodule(known, parent).get_submodule(last)
    return module


def _requires_grad_flags(
    module: nn.Module, flags_of: dict[int, frozenset[bool]]
) -> frozenset[bool]:
    """The ``requires_grad`` values of ``module``'s parameters: ``{True, False}`` when it mixes
    frozen and trainable ones (a LoRA'd DiT).

    ``flags_of`` memoises them per module (by id), so nested leaves share one walk instead of
    each walking its whole subtree (``module.parameters()`` per leaf was quadratic in depth).
    """
    known = flags_of.get(id(module))
    if known is None:
        flags = {param.requires_grad for param in module._parameters.values() if param is not None}
        for child in module._modules.values():
            if child is not None:
                flags |= _requires_grad_flags(child, flags_of)
        known = flags_of[id(module)] = frozenset(flags)
    return known


def _recording(
    tracer: Any, qualified_name: str, method_name: str, original: Any, *, inline: bool
) -> Any:
    """``original`` (a bound method), recorded as one node when called on traced values.

    ``functools.wraps`` keeps its signature: library code inspects it (transformers'
    ``apply_chunking_to_forward`` counts the parameters of the forward it is given).

    ``inline``: the module mixes frozen and trainable parameters. A method other than
    ``forward`` (``dit.patchify(x)``, ``dit.unpatchify(x, grid)``) is then traced into, its
    submodules staying leaves, so stage 2 holds only the submodules and parameters the method
    uses instead of the whole module with every frozen weight in it. If tracing into it
    fails, the call is recorded as one node, as for other modules.
    """

    def recorded(*args: Any, **kwargs: Any) -> Any:
        if tracer.computing_meta or not _contains_proxy((args, kwargs)):
            return original(*args, **kwargs)
        if inline:
            with tracer.rolled_back_on_error():
                return original(*args, **kwargs)
            # It failed, and what it traced was undone: record the call whole.
        handle = tracer.module_proxy(qualified_name)
        return tracer.create_proxy("call_method", method_name, (handle, *args), kwargs)

    return wrapped_like(recorded, original)


def wrapped_like(wrapper: FunctionType, original: Any) -> FunctionType:
    """``functools.wraps(original)(wrapper)``, quickly for the usual bound method.

    A big model's leaves get one wrapper per public method (SDXL: 20,513); ``update_wrapper``
    costs about 4 µs each through its generic attribute loop, assigning the same attributes
    from the method's function directly a fraction of that. Anything else (a ``partial`` an
    accelerate hook installed as ``forward``) goes through ``update_wrapper``.
    """
    if type(original) is not MethodType:
        return functools.update_wrapper(wrapper, original)
    function = original.__func__
    if type(function) is not FunctionType:
        return functools.update_wrapper(wrapper, original)
    for name in _WRAPPER_ASSIGNMENTS:  # __module__, __name__, __qualname__, __doc__, ...
        setattr(wrapper, name, getattr(function, name))
    if function.__dict__:
        wrapper.__dict__.update(function.__dict__)
    wrapper.__wrapped__ = original
    return wrapper


# What update_wrapper assigns in this Python version (3.12 adds __type_params__); a plain
# function has every one of them.
_WRAPPER_ASSIGNMENTS = functools.WRAPPER_ASSIGNMENTS


def is_recording_wrapper(function: FunctionType) -> bool:
    """Whether ``function`` is the tracer's wrapper of a leaf's method (:func:`_recording`):
    while a node's meta value is computed it only calls the method it wraps."""
    return function.__code__ is _RECORDING_CODE


def _any_method() -> None:
    pass


_RECORDING_CODE = _recording(None, "", "", _any_method, inline=False).__code__


# -- torch calls the tracer would otherwise run for real -----------------------------------------
# Every torch function that draws random numbers. fx records them when an argument is traced;
# without one (torch.randint(0, 1000, (1,)), torch.normal(..., device="cpu")) they would run
# once, at trace time, and the plan would replay that one draw forever.
RANDOM_FUNCTIONS = frozenset(
    {
        torch.rand,
        torch.randn,
        torch.randint,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        torch.normal,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.poisson,
        torch.nn.functional.dropout,
        torch.nn.functional.dropout1d,
        torch.nn.functional.dropout2d,
        torch.nn.functional.dropout3d,
        torch.nn.functional.alpha_dropout,
        torch.nn.functional.feature_alpha_dropout,
    }
)
# In-place random fills on a tensor the tracer does not follow (torch.empty(3).normal_()).
RANDOM_FILLS = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.bernoulli_,
        torch.Tensor.exponential_,
        torch.Tensor.geometric_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
        torch.Tensor.random_,
    }
)


_INDEXING = {torch.Tensor.__getitem__: operator.getitem, torch.Tensor.__setitem__: operator.setitem}


class TracedTorchCalls(TorchFunctionMode):
    """Records, as graph nodes, torch calls that hold no traced value but must not run now.

    - random draws (:data:`RANDOM_FUNCTIONS`, :data:`RANDOM_FILLS`): one node each, in order,
      whatever their arguments (an explicit ``device=``, a ``generator=``);
    - indexing a real tensor with a traced index (``sigmas[step_ids]``): torch would first
      probe the index as a Python sequence (``len``, ``int``), which a traced value cannot
      answer; recorded as one ``getitem`` (and ``setitem`` likewise).

    Calls made while the tracer computes a node's value (``tracer.computing_meta``) run as is.
    """

    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tracer.computing_meta:
            return func(*args, **kwargs)
        traced = _contains_proxy((args, kwargs))
        if traced:
            self.tracer.drop_pending_guards((args, kwargs))
        if func in RANDOM_FUNCTIONS and not traced:
            return self.tracer.record_call(func, args, kwargs)
        if func in RANDOM_FILLS and not traced:
            tensor, *rest = args
            return self.tracer.record_call(
                functional_inplace, (tensor, func.__name__, *rest), kwargs
            )
        if func in _INDEXING and not traced and _slice_holds_proxy(args[1]):
            traced = True  # real[:n] with a traced n: one getitem node, the bound stays traced
        if func in _INDEXING and traced and not isinstance(args[0], fx.Proxy):
            return self.tracer.record_call(_INDEXING[func], args, kwargs)
        if traced:
            # Straight to the proxies' handler: torch's argument parser would first turn a
            # traced size in an int list (torch.randint(0, 10, (x.shape[0],))) into a Python
            # int through __index__, baking the batch size into the plan.
            return fx.Proxy.__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)


def _slice_holds_proxy(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(
        isinstance(item, slice) and _contains_proxy((item.start, item.stop, item.step))
        for item in items
    )


@contextlib.contextmanager
def traced_torch_calls(tracer: Any) -> Iterator[None]:
    """Record random draws and real-tensor indexing with traced indices (see above)."""
    with TracedTorchCalls(tracer):
        yield


# -- range() over traced sizes ------------------------------------------------------------------
class _RangeType(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _BUILTIN_RANGE)


_BUILTIN_RANGE = range


@contextlib.contextmanager
def traced_range(to_int: Callable[[fx.Proxy], int]) -> Iterator[None]:
    """``range(x.shape[1])`` works while tracing: ``to_int`` turns traced sizes into ints."""

    class TracedRange(metaclass=_RangeType):
        def __new__(cls, *args: Any) -> range:
            args = tuple(to_int(arg) if isinstance(arg, fx.Proxy) else arg for arg in args)
            return _BUILTIN_RANGE(*args)

    builtins.range = TracedRange
    try:
        yield
    finally:
        builtins.range = _BUILTIN_RANGE


# -- factories with traced sizes ------------------------------------------------------------------
_SIZE_VARARG_FACTORIES = ("zeros", "ones", "empty", "rand", "randn")


def _is_traced_int(arg: Any) -> bool:
    """A traced value standing for one size; a traced ``torch.Size`` (``torch.randn(h.shape)``)
    is already the whole size and is passed on as it is."""
    return isinstance(arg, fx.Proxy) and not isinstance(
        arg.node.meta.get("val"), (tuple, list, torch.Size)
    )


def _packing_sizes(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.zeros(h, w, 3)`` with traced ``h``/``w``: torch's parser takes them as a tuple."""

    def factory_with_traced_sizes(*args: Any, **kwargs: Any) -> Any:
        if any(_is_traced_int(arg) for arg in args) and all(
            isinstance(arg, int) or _is_traced_int(arg) for arg in args
        ):
            return factory(tuple(args), **kwargs)
        return factory(*args, **kwargs)

    return factory_with_traced_sizes


@contextlib.contextmanager
def traced_factories() -> Iterator[None]:
    """``torch.zeros`` / ``ones`` / ``empty`` / ``rand`` / ``randn`` accept traced sizes."""
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


# -- torch.utils.checkpoint.checkpoint ------------------------------------------------------------
# Options of checkpoint() that stage 2 passes on (context_fn, a callable, is held by the stage
# module, see graphsplit.planning.rules.checkpoint).
CHECKPOINT_OPTIONS = (
    "use_reentrant",
    "preserve_rng_state",
    "determinism_check",
    "debug",
    "early_stop",
    "context_fn",
)


@contextlib.contextmanager
def checkpoints_recorded(tracer: Any) -> Iterator[None]:
    """Tag the nodes traced inside each ``torch.utils.checkpoint.checkpoint`` call.

    DiffSynth (``torch.utils.checkpoint.checkpoint(create_custom_forward(block), *args,
    use_reentrant=False)``) and diffusers (``self._gradient_checkpointing_func(block, ...)``,
    which calls ``torch.utils.checkpoint.checkpoint(block.__call__, ...)``) look the function
    up on ``torch.utils.checkpoint`` when they call it, so replacing that attribute sees both.
    Code that took the function earlier (``from torch.utils.checkpoint import checkpoint``;
    transformers' ``functools.partial(checkpoint, **kwargs)`` made by
    ``gradient_checkpointing_enable``) still runs torch's own ``checkpoint``, which looks up its
    two engines when called: those are replaced too (:func:`_checkpoint_engines_recorded`).
    ``tracer.open_checkpoint(options)`` / ``tracer.close_checkpoint(token)`` bracket the
    traced call; regions nested in a region belong to the outer one.
    """
    module = torch.utils.checkpoint
    original = module.checkpoint

    @functools.wraps(original)
    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        if tracer.computing_meta or not _contains_proxy((args, kwargs)):
            return original(function, *args, **kwargs)
        options = {name: kwargs.pop(name) for name in CHECKPOINT_OPTIONS if name in kwargs}
        token = tracer.open_checkpoint(options)
        try:
            return function(*args, **kwargs)
        finally:
            tracer.close_checkpoint(token)

    module.checkpoint = checkpoint
    try:
        with _checkpoint_engines_recorded(tracer, original):
            yield
    finally:
        module.checkpoint = original


@contextlib.contextmanager
def _checkpoint_engines_recorded(tracer: Any, checkpoint: Callable[..., Any]) -> Iterator[None]:
    """Tag a call of torch's own ``checkpoint`` (reached by an earlier-taken reference).

    ``checkpoint`` runs ``use_reentrant=False`` through the generator
    ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state, context_fn,
    determinism_check, debug, early_stop, *args, **kwargs)``, advanced once before and once
    after ``fn(*args, **kwargs)``, and ``use_reentrant=True`` through
    ``CheckpointFunction.apply(fn, preserve_rng_state, *args)``; both are module globals it
    looks up on each call. With traced arguments, the stand-ins open a region instead of
    saving tensors (the options differing from ``checkpoint``'s defaults are kept); otherwise
    they are torch's own.
    """
    module = torch.utils.checkpoint
    generator, function_class = (
        module._checkpoint_without_reentrant_generator,
        module.CheckpointFunction,
    )
    engine = inspect.signature(generator)
    signature = inspect.signature(inspect.unwrap(checkpoint))
    defaults = {name: parameter.default for name, parameter in signature.parameters.items()}
    defaults["preserve_rng_state"] = True
    defaults["context_fn"] = module.noop_context_fn

    def options_of(arguments: dict[str, Any], use_reentrant: bool) -> dict[str, Any]:
        changed = {
            name: arguments[name]
            for name in CHECKPOINT_OPTIONS
            if name in arguments and arguments[name] != defaults.get(name)
        }
        return {"use_reentrant": use_reentrant, **changed}

    def without_reentrant(*args: Any, **kwargs: Any) -> Iterator[None]:
        arguments = engine.bind(*args, **kwargs).arguments
        traced = (arguments.get("args", ()), arguments.get("kwargs", {}))
        if tracer.computing_meta or not _contains_proxy(traced):
            yield from generator(*args, **kwargs)
            return
        token = tracer.open_checkpoint(options_of(arguments, use_reentrant=False))
        try:
            yield
        finally:
            tracer.close_checkpoint(token)

    class ReentrantCheckpoint:
        @staticmethod
        def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            if tracer.computing_meta or not _contains_proxy(args):
                return function_class.apply(function, preserve_rng_state, *args)
            arguments = {"preserve_rng_state": preserve_rng_state}
            token = tracer.open_checkpoint(options_of(arguments, use_reentrant=True))
            try:
                return function(*args)
            finally:
                tracer.close_checkpoint(token)

    module._checkpoint_without_reentrant_generator = without_reentrant
    module.CheckpointFunction = ReentrantCheckpoint
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = generator
        module.CheckpointFunction = function_class


# -- torch.Tensor(...) ----------------------------------------------------------------------------
@contextlib.contextmanager
def legacy_constructor_recorded(tracer: Any) -> Iterator[None]:
    """``torch.Tensor([guidance] * latents.shape[0])`` with a traced argument: one node.

    The legacy constructor is ``Tensor.__new__``, which torch's C++ runs without asking any
    ``__torch_function__`` handler, so a traced list (or size) reached it as an object it
    cannot read ("not a storage"). Replaced for the trace, it records the call as
    ``torch.Tensor(...)`` (stage code runs it as written, eager's dtype and device rules
    included); without traced arguments, and for subclasses, it is torch's own.
    """
    original = torch.Tensor.__new__
    own = vars(torch.Tensor).get("__new__")  # None: inherited from torch._C.TensorBase

    def legacy_constructor(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is torch.Tensor and not tracer.computing_meta and _contains_proxy((args, kwargs)):
            return tracer.create_proxy("call_function", torch.Tensor, args, kwargs)
        return original(cls, *args, **kwargs)

    torch.Tensor.__new__ = staticmethod(legacy_constructor)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del torch.Tensor.__new__
        else:
            torch.Tensor.__new__ = own  # type: ignore[method-assign]


# -- torch._check(...) ----------------------------------------------------------------------------
@contextlib.contextmanager
def tensor_checks_assumed() -> Iterator[None]:
    """torch's run-time checks on traced conditions are assumed to hold, as torch.export does.

    transformers' ``torch_compilable_check`` (LLaVA's "image features and image tokens do not
    match") ends in ``torch._check_tensor_all_with(error, cond, message)``, which reads
    ``cond._is_all_true().item()``, or in ``torch._check_with``, which insists on a real
    ``bool``: a traced condition has no value yet. A check states what must hold for the step
    to run at all; it changes no value, so the plan is the same whether it holds or not, and
    leaf modules still run their own checks on real data in the stages. Checks on real values
    run as usual.
    """
    originals = {name: getattr(torch, name) for name in ("_check_with", "_check_tensor_all_with")}

    def assumed(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def check(error_type: Any, cond: Any, message: Any = None) -> None:
            if isinstance(cond, fx.Proxy):
                return None
            return original(error_type, cond, message)

        return check

    for name, original in originals.items():
        setattr(torch, name, assumed(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


# -- einops ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def einops_calls_recorded(tracer: Any) -> Iterator[None]:
    """``rearrange(x, pattern, f=f)`` / ``repeat(...)`` on traced values: one node each.

    Traced values pass einops' ``isinstance`` check, so einops would run on them op by op
    (a dozen ``reshape`` / ``permute`` / size-arithmetic nodes per call, correct but hard to
    read). Both functions call ``einops.einops.reduce`` by its global name, which is replaced
    here, so the call is recorded as written: ``einops.rearrange(x, 'b c f h w -> b (f h w)
    c')``, its axis lengths traced. einops is not imported here: only a step that uses it
    has it loaded.
    """
    module = sys.modules.get("einops.einops")
    if module is None or not callable(getattr(module, "reduce", None)):
        yield
        return
    original = module.reduce
    as_written = {"rearrange": module.rearrange, "repeat": module.repeat}

    @functools.wraps(original)
    def reduce(tensor: Any, pattern: str, reduction: Any, **axes_lengths: Any) -> Any:
        traced = _contains_proxy((tensor, axes_lengths))
        if tracer.computing_meta or not traced or not isinstance(reduction, str):
            return original(tensor, pattern, reduction, **axes_lengths)
        if reduction in as_written:
            return tracer.create_proxy(
                "call_function", as_written[reduction], (tensor, pattern), axes_lengths
            )
        return tracer.create_proxy(
            "call_function", original, (tensor, pattern, reduction), axes_lengths
        )

    module.reduce = reduce
    try:
        yield
    finally:
        module.reduce = original
