"""What a step callable's code reaches: the modules, tensors and helper objects it can see.

:func:`~graphsplit.planning.step.callables.as_step_module` wraps a user's function into the
step module; this module finds what that module must hold, and under which names (the table
in :mod:`graphsplit.planning.step.callables`' docstring).

Glossary:
    reached object: a value the callable's code can see without being passed it: the default
        values of the parameters the call leaves out, its closure cells, the globals its code
        loads (also those of nested code and of helper functions defined in the same Python
        module, with their defaults), ``self``'s attributes for a bound method, and the
        modules (or containers) its code loads as attributes of an imported Python module
        (``models.teacher``, held as ``models_teacher``).
    holder: a module made to hold the modules of a dict, list, tuple or plain object
        (``models["unet"]``, ``pipe.unet``) under the keys the code uses.
    helper object: a reached non-module object with attributes (a diffusers scheduler); the
        step module holds it as a plain attribute, so the analysis restores whatever tracing
        rebinds on it.

Each object is reached once, under the first name it is seen by.

In: the callable (a Python function), its ``self`` and the parameters the call passes. Out:

    reached = Reached(); reached.add_owner(owner)
    reach_code(function, reached, set(), passed=frozenset(names))
    reached.modules / .tensors / .helpers: dict[str, ...]
    usable_name(name) -> bool     # a name a module attribute can have
"""

from __future__ import annotations

import dis
import functools
import inspect
import keyword
import types
from typing import Any

import torch
from torch import nn

from graphsplit.errors import Fix, SplitError, user_error

__all__ = ["Reached", "reach_code", "usable_name"]

# What the step module holds itself (``forward``, ``_modules``, ``modules``, ``training``...):
# a reached object of such a name would overwrite it. Modules the code names so are refused
# with the fix; a tensor stays a traced constant, a helper or an attribute of ``self`` that the
# code may not use is left out.
_STEP_MODULE_NAMES = frozenset(dir(nn.Module)) | frozenset(vars(nn.Module())) | {"step_callable"}


class Reached:
    """Reached modules, tensors and helper objects by name, each object once."""

    def __init__(self) -> None:
        self.modules: dict[str, nn.Module] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.helpers: dict[str, Any] = {}
        self._seen: set[int] = set()

    def _claim(self, name: str, value: Any, *, modules_named_by_code: bool = False) -> bool:
        taken = name in self.modules or name in self.tensors or name in self.helpers
        if id(value) in self._seen or taken or not usable_name(name):
            return False
        if name in _STEP_MODULE_NAMES:
            if modules_named_by_code:
                raise user_error(
                    SplitError,
                    f"The step reaches modules through the name {name!r}, which torch.nn.Module "
                    f"uses itself (nn.Module.{name}), so the step module cannot hold them "
                    "under it.",
                    fix=Fix(f"rename {name!r} in the step's code (e.g. my_{name})"),
                )
            return False
        self._seen.add(id(value))
        return True

    def add(self, name: str, value: Any, *, named_by_code: bool = True) -> None:
        """Reach ``value`` under ``name``; ``named_by_code``: the code uses that name (not an
        attribute of ``self`` reached with all the others)."""
        if isinstance(value, nn.Module):
            if self._claim(name, value, modules_named_by_code=named_by_code):
                self.modules[name] = value
        elif isinstance(value, torch.Tensor):
            if self._claim(name, value):
                self.tensors[name] = value
        elif isinstance(value, (dict, list, tuple)) or _holds_attributes(value):
            # A container or a pipeline-like object (callable or not) holding modules.
            holder = _holder(value)
            if holder is not None:
                if self._claim(name, value, modules_named_by_code=named_by_code):
                    self.modules[name] = holder
            elif _holds_attributes(value) and _is_helper_object(value) and self._claim(name, value):
                self.helpers[name] = value

    def add_owner(self, owner: Any) -> None:
        """``self`` of a bound method: its attributes, under their own names.

        A module's private attributes are its internals (``_modules``, hooks); a plain object's
        (a trainer's ``self._teacher``) are the user's, so they are reached too, after the public
        ones, then ``__slots__`` and modules set on the class itself.
        """
        if isinstance(owner, nn.Module):  # its own tensors are shared, see _share_tensors
            for name, child in owner._modules.items():
                if child is not None:
                    self.add(name, child)
            self._seen |= {id(tensor) for tensor in (*owner._parameters.values(),)}
            self._seen |= {id(tensor) for tensor in owner._buffers.values()}
            for name, value in vars(owner).items():
                if not name.startswith("_"):
                    self.add(name, value, named_by_code=False)
            return
        attributes = _plain_attributes(owner)
        for name in sorted(attributes, key=lambda name: name.startswith("_")):  # stable
            self.add(name, attributes[name], named_by_code=False)


def _plain_attributes(owner: Any) -> dict[str, Any]:
    """A plain object's instance attributes, its ``__slots__`` values, its class's modules."""
    attributes = dict(vars(owner)) if hasattr(owner, "__dict__") else {}
    for klass in type(owner).__mro__:
        slots = vars(klass).get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in attributes and hasattr(owner, slot):
                attributes[slot] = getattr(owner, slot)
    for klass in type(owner).__mro__[:-1]:  # not ``object``
        for name, value in vars(klass).items():
            if name not in attributes and isinstance(value, (nn.Module, dict, list, tuple)):
                attributes[name] = value
    return attributes


def usable_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("__")


def _holds_attributes(value: Any) -> bool:
    """An instance with its own attributes: not a class, Python module, function or method."""
    plain = (type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial)
    return hasattr(value, "__dict__") and not isinstance(value, plain)


def _is_helper_object(value: Any) -> bool:
    if isinstance(value, (type, types.ModuleType, torch.Tensor)) or callable(value):
        return False
    return hasattr(value, "__dict__")


class _Holder(nn.Module):
    """Holds the modules of a dict, list, tuple or plain object under the keys the code uses."""


def _holder(value: Any) -> nn.Module | None:
    """A module holding ``value``'s modules (and its helper objects), or None if it has none."""
    if isinstance(value, dict):
        items = [(key, item) for key, item in value.items() if isinstance(key, str)]
    elif isinstance(value, (list, tuple)):
        items = [(str(index), item) for index, item in enumerate(value)]
    else:
        items = list(vars(value).items())
    modules = [
        (key, item)
        for key, item in items
        if isinstance(item, nn.Module) and key and "." not in key and not key.startswith("_")
    ]
    if not modules:
        return None
    holder = _Holder()
    for key, module in modules:
        holder.add_module(key, module)
    if not isinstance(value, (dict, list, tuple)):
        for key, item in items:  # kept so the analysis restores what tracing rebinds on them
            if _is_helper_object(item) and key.isidentifier() and not hasattr(holder, key):
                setattr(holder, key, item)
    return holder


def reach_code(
    function: types.FunctionType,
    reached: Reached,
    visited: set[int],
    passed: frozenset[str] = frozenset(),
) -> None:
    """Defaults, closure cells, then loaded globals (nested code and same-module helpers too).

    ``passed``: the parameters the call gives a value; the others run with their defaults
    (``def step(batch, frozen=frozen)``), which the code then reaches under the parameter's name.
    """
    if id(function) in visited:
        return
    visited.add(id(function))
    code = function.__code__
    values = function.__defaults__ or ()
    names = code.co_varnames[code.co_argcount - len(values) : code.co_argcount]
    for name, value in [*zip(names, values), *(function.__kwdefaults__ or {}).items()]:
        if name not in passed:
            reached.add(name, value)
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: assigned after the function was defined
            continue
        if isinstance(value, (types.FunctionType, functools.partial)):
            _reach_callable(value, reached, visited)  # a helper the script made in main()
        else:
            reached.add(name, value)
    namespace = function.__globals__
    for name in _loaded_globals(code):
        if name not in namespace:
            continue
        value = namespace[name]
        if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
            reach_code(value, reached, visited)  # a helper defined beside the step
        else:
            reached.add(name, value)
    for name, attribute in _module_attributes(code):
        module = namespace.get(name)
        if isinstance(module, types.ModuleType):
            value = getattr(module, attribute, None)
            # ``import models; models.teacher(...)``: the models another file of the script made
            if isinstance(value, (nn.Module, dict, list, tuple)):
                reached.add(f"{name}_{attribute}", value)


def _reach_callable(value: Any, reached: Reached, visited: set[int]) -> None:
    """A local helper in a closure cell: what it reaches, and what a ``functools.partial``
    binds under the names of the parameters it fills (diffusers' LCM script calls
    ``compute_embeddings_fn = functools.partial(compute_embeddings, text_encoder=...)``)."""
    while isinstance(value, functools.partial):
        if id(value) in visited:
            return
        visited.add(id(value))
        try:
            bound = inspect.signature(value.func).bind_partial(*value.args, **value.keywords)
        except (TypeError, ValueError):  # a builtin or a partial binding too much: its values
            bound = None  # are reached by keyword only
        named = dict(bound.arguments) if bound is not None else dict(value.keywords)
        for name, item in named.items():
            reached.add(name, item)
        value = value.func
    if isinstance(value, types.FunctionType):
        reach_code(value, reached, visited)


def _module_attributes(code: types.CodeType) -> list[tuple[str, str]]:
    """``(global, attribute)`` for each ``global.attribute`` ``code`` (and the code nested in
    it) loads, in first-load order: the attributes of a Python module the step names."""
    pairs: list[tuple[str, str]] = []
    previous = None
    for instruction in dis.get_instructions(code):
        if (
            instruction.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and previous is not None
            and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME")
        ):
            owner = str(previous.argval).removesuffix(" + NULL").removeprefix("NULL + ")
            attribute = str(instruction.argval)
            if (owner, attribute) not in pairs:
                pairs.append((owner, attribute))
        previous = instruction
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            pairs += [pair for pair in _module_attributes(constant) if pair not in pairs]
    return pairs


def _loaded_globals(code: types.CodeType) -> list[str]:
    """Names ``code`` (and the code nested in it) loads as globals, in first-load order."""
    names: list[str] = []
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            name = str(instruction.argval).removesuffix(" + NULL").removeprefix("NULL + ")
            if name not in names:
                names.append(name)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names += [name for name in _loaded_globals(constant) if name not in names]
    return names
