"""Turn what the user wrote (a function, a closure, a bound method) into the step module.

Training scripts hold their models as locals, globals or attributes of a trainer and run the
step as a loop body, not as one ``nn.Module``. :func:`as_step_module` finds the modules such a
callable reaches and wraps it into a module the planning steps take unchanged: its ``forward``
has the callable's signature and calls the callable, and its children are the *same* module
objects the callable's code uses, so stage 2 calls them too (an optimizer built on the user's
modules trains stage 2).

Glossary:
    step callable: what :func:`graphsplit.split` is given. An ``nn.Module`` is used as is; a
        Python function (``def`` or lambda, closures included), a bound method (of a module or
        of a plain object such as a trainer), an object whose class defines ``__call__`` in
        Python, or a ``functools.partial`` of one of these is wrapped.
    reached object: a value the callable's code can see without being passed it by the batch:
        the values a ``functools.partial`` binds, the defaults of the parameters the batch
        leaves out, its closure cells, the globals its code loads (also those of nested code
        and of helper functions defined in the same Python module), ``self``'s attributes for a
        bound method, and the arguments of the example batch that are modules.
    step module: the wrapper, a subclass of :class:`FunctionStep` named after the callable.
    helper object: a reached non-module object with attributes (a diffusers scheduler); the
        step module holds it as a plain attribute, so the analysis restores whatever tracing
        rebinds on it (``add_noise`` rebinds ``alphas_cumprod``).

What a reached module is called (its parameters' and stage 2's state-dict keys start with it):

    ============================================  =========================================
    the code uses                                 names
    ============================================  =========================================
    a global or closure variable ``unet``         ``unet.*``
    ``self.unet`` in a bound method               ``unet.*`` (``self`` is not a prefix; also
                                                  for a plain object such as a trainer)
    a method of an ``nn.Module`` ``model``        ``model.state_dict()``'s own keys
    an argument ``unet`` that is a module         ``unet.*`` (it leaves the batch inputs)
    a default, ``def step(x, frozen=frozen)``     ``frozen.*`` (the parameter's name)
    ``functools.partial(step, unet=unet)``        ``unet.*``
    ``functools.partial(step, unet)``             the name of the parameter it fills
    ``models["unet"]`` (a dict / list / tuple)    ``models.unet.*`` / ``models.0.*``
    ``pipe.unet`` (a plain object holding it)     ``pipe.unet.*``
    ============================================  =========================================

A tensor a ``functools.partial`` binds (a per-dataset constant) is reached like a global
tensor: a constant of the stages, the same for every batch. A module reachable under two
names keeps the first (arguments, then what a partial binds, ``self``, defaults, closure
cells, globals in the order the code loads them); one inside another reached module keeps
the outer module's path. :mod:`graphsplit.planning.step.reached_objects` finds what the code
reaches; this module checks the callable and builds the step module around it.

In: the step callable and the example batch. Out: :class:`StepCall`:

    as_step_module(step, args, kwargs) -> StepCall(module, args, kwargs)
"""

from __future__ import annotations

import collections
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import frame_location_of
from graphsplit.planning.step.compiled_steps import refuse_compiled_step
from graphsplit.planning.step.raw_samples import is_raw_sample
from graphsplit.planning.step.reached_objects import Reached, reach_code, usable_name

STEP_SHAPE_FIX = Fix(
    "pass the function that runs one training step and returns the loss, e.g. "
    "graphsplit.split(training_step, (pixel_values, input_ids)), or an nn.Module whose forward "
    "does"
)


@dataclass(frozen=True)
class StepCall:
    """The step module and the example batch it takes (module arguments removed)."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class FunctionStep(nn.Module):
    """Base class of step modules: a user's callable and the modules it reaches.

    ``step_callable`` is the wrapped callable; calling the step module with the batch (without
    module arguments) calls it with the same objects.
    """

    step_callable: Any


def _takes_a_dict_batch(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``module(*args, **kwargs)`` passes a dict holding tensors (or a raw sample)
    to ``forward``."""
    try:
        bound = inspect.signature(module.forward).bind(
            *(args if isinstance(args, tuple) else (args,)), **kwargs
        )
    except TypeError:
        return False  # bind_examples names the mismatch
    return any(_spreads(value) for value in bound.arguments.values())


def _spreads(value: Any) -> bool:
    """Whether a step argument is a dict batch whose fields become inputs of their own: a plain
    dict, an ``OrderedDict`` or a ``UserDict`` (transformers' ``BatchEncoding``, what its
    collators return) that holds a tensor (or a plain dict of them: ``{"unet_added_conditions":
    {"text_embeds": ..., "time_ids": ...}}``) or is a raw sample. The step gets the same type
    back, rebuilt from the fields (:func:`_forward`); other dict subclasses (a ``defaultdict``
    cannot be rebuilt from its items alone) stay one value."""
    if not (
        type(value) in (dict, collections.OrderedDict) or isinstance(value, collections.UserDict)
    ):
        return False
    return any(_holds_tensor(v) for v in value.values()) or is_raw_sample(dict(value))


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return type(value) is dict and any(isinstance(v, torch.Tensor) for v in value.values())


def as_step_module(step: Any, args: Any, kwargs: dict[str, Any]) -> StepCall:
    """``step`` as a module whose ``forward`` takes the batch; ``step`` itself if a module.

    Raises:
        SplitError: ``step`` is not a callable graphsplit can trace (a class, a builtin, a
            generator), or it reaches no ``nn.Module``, or it is ``torch.compile``'d.
    """
    refuse_compiled_step(step)
    if isinstance(step, nn.Module):
        if not _takes_a_dict_batch(step, args, kwargs):
            return StepCall(step, args, kwargs)
        # ``forward(self, batch)`` with a dict of tensors: its fields must be inputs of their
        # own (each batched along dim 0), so the bound method is split, which spreads them.
        step = step.forward
    if isinstance(step, functools.partial) and isinstance(step.func, nn.Module):
        # A module's ``__call__`` takes ``*args``: its ``forward`` names the parameters.
        step = functools.partial(step.func.forward, *step.args, **step.keywords)
    function, owner = _python_function(_partial_target(step))
    if not isinstance(args, tuple):
        args = (args,)
    given = _partial_arguments(step)
    signature = _signature(step, function)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise user_error(
            SplitError,
            f"The example batch does not match {_describe(function)}: {exc}.",
            fix=Fix("pass args/kwargs exactly as you would call the function"),
        ) from None
    module_arguments = {
        name: value for name, value in bound.arguments.items() if isinstance(value, nn.Module)
    }
    reached = Reached()
    for name, value in module_arguments.items():
        reached.add(name, value)
    for name, value in given.items():
        if name not in bound.arguments:  # the batch may pass a keyword the partial binds
            reached.add(name, value)
    if owner is not None:
        reached.add_owner(owner)
    reach_code(function, reached, set(), passed=frozenset(bound.arguments) | frozenset(given))
    if not reached.modules:
        raise user_error(
            SplitError,
            f"{_describe(function)} reaches no torch.nn.Module, so there is nothing to freeze, "
            "train or split.",
            fix=Fix(
                "use the models in the step's own code (as globals, closure variables, "
                "attributes of self, arguments or their defaults); a lambda that calls a "
                "function holding the models hides them: pass that function instead"
            ),
        )
    spread = _spread_dicts(function, signature, bound.arguments)
    rebuilt = {
        name: type(value)
        for name, value in bound.arguments.items()
        if name in spread and type(value) is not dict
    }
    # Parameters the example batch leaves out keep their defaults: they are not step inputs.
    passed = inspect.Signature([signature.parameters[name] for name in bound.arguments])
    module = _build(step, function, owner, passed, module_arguments, spread, rebuilt, reached)
    positional, batch = [], {}
    for name, value in bound.arguments.items():
        if name in module_arguments:
            continue
        if name in spread:
            batch.update(value)
        elif passed.parameters[name].kind is inspect.Parameter.POSITIONAL_ONLY:
            positional.append(value)
        else:
            batch[name] = value
    return StepCall(module, tuple(positional), batch)


def _spread_dicts(
    function: types.FunctionType, signature: inspect.Signature, arguments: dict[str, Any]
) -> dict[str, tuple[str, ...]]:
    """Parameters given a dict batch (``batch["pixel_values"]``): ``{parameter: its keys}``.

    The step module takes such a dict's fields as parameters of their own and rebuilds the
    dict, so the batch a ``DataLoader`` yields is what ``stage1(**batch)`` takes, and the
    batch dimension of each field is seen. A plain dict holding a tensor is spread, and so is
    a raw sample (:mod:`.raw_samples`: PIL images and strings, DiffSynth's ``data``); its keys
    must be identifiers that no other parameter uses.
    """
    taken = set(signature.parameters)
    spread: dict[str, tuple[str, ...]] = {}
    for name, value in arguments.items():
        if not _spreads(value):
            continue
        keys = tuple(value)
        bad = [
            key
            for key in keys
            if not (isinstance(key, str) and usable_name(key))
            or key in taken - {name}
            or key.startswith("_graphsplit")
        ]
        if bad:
            raise user_error(
                SplitError,
                f"{_describe(function)} takes the dict {name!r}, whose fields become stage 1's "
                f"inputs, but its keys {bad!r} are not Python names or are already parameter "
                "names.",
                fix=Fix(
                    "rename those fields in the dataset / collate_fn (or the parameters), "
                    "e.g. 'pixel_values', 'input_ids'"
                ),
            )
        spread[name] = keys
        taken |= set(keys)
    return spread


# -- which callables ----------------------------------------------------------------------------
def _python_function(step: Any) -> tuple[types.FunctionType, Any]:
    """``(function, self or None)`` behind ``step``; a SplitError naming the fix otherwise."""
    if isinstance(step, type):
        raise user_error(
            SplitError,
            f"graphsplit.split got the class {step.__qualname__}, not a training step.",
            fix=Fix(
                f"pass an instance (graphsplit.split({step.__name__}(...), args)) or the "
                "function that runs the step"
            ),
        )
    if inspect.ismethod(step):
        function, owner = step.__func__, step.__self__
    elif isinstance(step, types.FunctionType):
        function, owner = step, None
    elif isinstance(_class_call(step), types.FunctionType):
        function, owner = _class_call(step), step
    else:
        kind = "builtin " if isinstance(step, types.BuiltinFunctionType) else ""
        raise user_error(
            SplitError,
            f"graphsplit.split got the {kind}{type(step).__name__} {_name_of(step)}, which has "
            "no Python code to trace.",
            fix=STEP_SHAPE_FIX,
        )
    if not isinstance(function, types.FunctionType):
        raise user_error(
            SplitError,
            f"graphsplit.split got {_name_of(step)}, whose code is not Python.",
            fix=STEP_SHAPE_FIX,
        )
    if isinstance(owner, type):
        owner = None  # a classmethod: the class is not a holder of models
    for test, kind in (
        (inspect.isgeneratorfunction, "a generator function (it yields)"),
        (inspect.iscoroutinefunction, "an async function"),
        (inspect.isasyncgenfunction, "an async generator function"),
    ):
        if test(function):
            raise user_error(
                SplitError,
                f"{_describe(function)} is {kind}; graphsplit traces one call that returns "
                "the step's outputs.",
                fix=Fix(
                    "make it a plain function that runs one step and returns the loss "
                    "(keep the loop over batches outside it)"
                ),
            )
    return function, owner


def _partial_target(step: Any) -> Any:
    """What ``functools.partial`` layers around ``step`` call in the end (``step`` if none)."""
    while isinstance(step, functools.partial):
        step = step.func
    return step


def _partial_arguments(step: Any) -> dict[str, Any]:
    """The values ``functools.partial`` layers bind, by the name of the parameter they fill.

    ``partial(step, unet)`` binds ``step``'s first parameter; an outer layer's keyword wins over
    an inner one's, as when the partial is called.
    """
    given: dict[str, Any] = {}
    while isinstance(step, functools.partial):
        inner = step.func
        try:
            bound = inspect.signature(inner).bind_partial(*step.args, **step.keywords)
        except TypeError as exc:
            raise user_error(
                SplitError,
                f"functools.partial({_describe(_partial_target(inner))}, ...) binds values the "
                f"function does not take: {exc}.",
                fix=Fix("bind only the function's own parameters in the partial"),
            ) from None
        for name, value in bound.arguments.items():
            given.setdefault(name, value)
        step = inner
    return given


def _class_call(step: Any) -> Any:
    """The ``__call__`` ``step``'s class defines (or inherits), looked up on the class."""
    for klass in type(step).__mro__:
        if "__call__" in vars(klass):
            return vars(klass)["__call__"]
    return None


def _signature(step: Any, function: types.FunctionType) -> inspect.Signature:
    """The parameters the caller passes; refuses ``*args`` / ``**kwargs``."""
    signature = inspect.signature(step)  # without self for a bound method or callable object
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            star = "*" if parameter.kind is parameter.VAR_POSITIONAL else "**"
            raise user_error(
                SplitError,
                f"{_describe(function)} takes {star}{parameter.name}; graphsplit needs named "
                "inputs (they become stage 1's parameters and the cache's fields).",
                fix=Fix("give the function explicit parameters, one per batch field"),
            )
    return signature


def _name_of(value: Any) -> str:
    return getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)


def _describe(function: Any) -> str:
    """``training_step (train.py:42)``: the callable as the user knows it."""
    code = getattr(function, "__code__", None)
    if code is None:
        return _name_of(function)
    place, _ = frame_location_of(code.co_filename, code.co_firstlineno)
    return f"{_name_of(function)} ({place})"


# -- the step module ------------------------------------------------------------------------------
def _build(
    step: Any,
    function: types.FunctionType,
    owner: Any,
    signature: inspect.Signature,
    module_arguments: dict[str, nn.Module],
    spread: dict[str, tuple[str, ...]],
    rebuilt: dict[str, type],
    reached: Reached,
) -> nn.Module:
    forward = _forward(step, function, signature, module_arguments, spread, rebuilt)
    name = function.__name__ if function.__name__.isidentifier() else "function_step"
    cls = type(name, (FunctionStep,), {"forward": forward, "__doc__": function.__doc__})
    module = cls()
    module.step_callable = step
    for key, child in reached.modules.items():
        module.add_module(key, child)
    if isinstance(owner, nn.Module):
        _share_tensors(module, owner, function, reached)
    else:
        for key, tensor in reached.tensors.items():
            if isinstance(tensor, nn.Parameter):
                module.register_parameter(key, tensor)
            else:  # a global tensor is not the model's state: kept out of state dicts
                module.register_buffer(key, tensor, persistent=False)
    for key, helper in reached.helpers.items():
        setattr(module, key, helper)
    _drop_nested(module)
    return module


def _share_tensors(
    module: nn.Module, owner: nn.Module, function: types.FunctionType, reached: Reached
) -> None:
    """A module's method: the step module shares ``self``'s own parameter and buffer tables.

    The analysis swaps tensors in those tables for meta twins while it traces; sharing them
    means ``self.bias`` in the method reads the twin, and the keys stay the module's own.
    """
    module._parameters = owner._parameters
    module._buffers = owner._buffers
    module._non_persistent_buffers_set = owner._non_persistent_buffers_set
    for key, tensor in reached.tensors.items():
        if isinstance(tensor, nn.Parameter):  # registering it would change the user's module
            raise user_error(
                SplitError,
                f"{_describe(function)} uses the parameter {key!r}, which is neither "
                f"registered on {type(owner).__name__} nor an attribute of one of its modules.",
                fix=Fix(
                    f"register it on the module (self.{key} = nn.Parameter(...) in "
                    "__init__), so it has a name and trains"
                ),
            )
    # Other tensors become the stage's traced constants, held out of its state dict.


def _drop_nested(module: nn.Module) -> None:
    """A reached module inside another reached module keeps only the outer path."""
    children = dict(module._modules)
    inner = {
        id(sub) for key, child in children.items() for sub in child.modules() if sub is not child
    }
    for key, child in children.items():
        if id(child) in inner:
            del module._modules[key]


def _forward(
    step: Any,
    function: types.FunctionType,
    signature: inspect.Signature,
    module_arguments: dict[str, nn.Module],
    spread: dict[str, tuple[str, ...]],
    rebuilt: dict[str, type],
) -> Any:
    """``def forward(self, <the callable's batch parameters>): return step(...)`` on one line.

    A spread dict batch is rebuilt from its fields as the type it had (``rebuilt``: a
    ``BatchEncoding`` stays one, so ``batch.input_ids`` and ``batch.to(device)`` work as before).

    Compiled with the callable's file and first line, so reports point placeholders (the step's
    inputs) at the user's ``def``. Every argument is passed by name except positional-only ones.
    """
    parameters: list[str] = []
    call: list[str] = []
    defaults: dict[str, Any] = {}
    keyword_only = had_default = False

    def declare(name: str, default: Any, kind: inspect._ParameterKind) -> None:
        nonlocal keyword_only, had_default
        needs_star = kind is inspect.Parameter.KEYWORD_ONLY or (
            had_default and default is inspect.Parameter.empty
        )
        if needs_star and not keyword_only:
            parameters.append("*")
            keyword_only = True
        if default is inspect.Parameter.empty:
            parameters.append(name)
        else:
            had_default = True
            defaults[name] = default
            parameters.append(f"{name}=__defaults[{name!r}]")

    for parameter in signature.parameters.values():
        name, kind = parameter.name, parameter.kind
        if name in module_arguments:
            value = f"__modules[{name!r}]"
        elif name in spread:
            for key in spread[name]:
                declare(key, inspect.Parameter.empty, kind)
            value = "{" + ", ".join(f"{key!r}: {key}" for key in spread[name]) + "}"
            if name in rebuilt:
                value = f"__rebuilt[{name!r}]({value})"
        else:
            declare(name, parameter.default, kind)
            value = name
        call.append(value if kind is parameter.POSITIONAL_ONLY else f"{name}={value}")
    head = ", ".join(["_graphsplit_step", *parameters])
    source = f"def forward({head}): return __step({', '.join(call)})\n"
    namespace = {
        "__step": step,
        "__modules": dict(module_arguments),
        "__defaults": defaults,
        "__rebuilt": dict(rebuilt),
    }
    code = function.__code__
    exec(compile(source, code.co_filename, "exec"), namespace)
    forward = namespace["forward"]
    forward.__code__ = forward.__code__.replace(co_firstlineno=code.co_firstlineno)
    forward.__qualname__ = f"{function.__qualname__}.forward"
    return forward
