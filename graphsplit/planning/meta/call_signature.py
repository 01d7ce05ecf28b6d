"""The call signature: an exact, hashable key for what a module call's or a node's result
on meta can depend on.

Glossary:
    call signature: what a module call's result on meta can depend on: the module's class;
        the state of every module under it (each one's class, plain attributes, the
        metadata of its parameters and buffers, its children, recursively; functions held
        with their closure cells and defaults); the metadata of its tensor arguments (shape,
        stride, storage offset, dtype, device), which of them are one object or the module's
        own parameters (code branches on ``context is x``), and the values of the others;
        and torch's global modes (grad, autocast, default dtype, the mode stacks,
        which say whether an op recorder is on). A node's signature is the same with its
        function or tensor method in place of the module (and the module's state for a
        ``call_module`` node), plus whether its ops are recorded.
    no key: a value whose description would not be exact (a tensor attribute, an object of
        unknown kind, a hook): the parts below raise ``TypeError``, and the call memo then
        always runs the call.

In: arguments, modules, torch's global state. Out: the parts of a signature
(:mod:`graphsplit.planning.meta.call_memo` assembles them):

    value_key(value, depth, tensors=True) -> hashable   # arguments and attributes
    sameness(arguments, module) -> tuple                # which tensors are one object
    arguments_key(arguments, module) -> (sameness, value_key)   # both, in one walk
    module_key(module) -> tuple                         # the state of a module tree
    global_state() -> tuple                             # torch's global switches
    collect_tensors(tree, found, depth)                 # the tensors in plain containers

Called between traced nodes, so Python's own ``isinstance`` is used
(:mod:`graphsplit.planning.patching.originals`).
"""

from __future__ import annotations

import enum
from collections import Counter
from types import BuiltinFunctionType, FunctionType, MethodType
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.immutable_collections import immutable_dict

from graphsplit.planning.patching.leaf_methods import is_recording_wrapper
from graphsplit.planning.patching.originals import (
    PLAIN_VALUE_TYPES,
    python_isinstance,
    python_range,
)

# Hook tables that run around forward (``Module._call_impl`` reads them): a module or any
# module under it with one of them set is always run. State-dict hooks play no part in a call.
_CALL_HOOKS = frozenset(
    {
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
    }
)
_TABLES = frozenset({"_parameters", "_buffers", "_modules"})

# Functions and classes held as attributes are keyed by identity (what they are, not state).
_BY_IDENTITY = (FunctionType, BuiltinFunctionType, type)
# Plain tensors on meta (the example inputs' twins) hold no value: keyed by metadata too.
_META_TENSORS = frozenset({torch.Tensor, nn.Parameter})
DEPTH = 6  # nesting of plain containers and helper objects a key follows before refusing


def value_key(value: Any, depth: int, *, tensors: bool = True) -> Any:
    """An exact, hashable description of an argument or attribute; ``TypeError`` if none.

    Tensors are described by metadata (only fake tensors without a known value and plain
    meta tensors: a real tensor's value could steer Python code); containers by their items;
    helper objects (an attention processor, a config) by their class and attributes.
    ``tensors=False`` (a module's attributes): a tensor has no key, since the call could
    return it, and a fresh copy would not alias it as the run's result does.
    """
    kind = type(value)
    if kind in PLAIN_VALUE_TYPES:
        if kind is float:
            return (float, value.hex())  # -0.0 == 0.0, and nan equals nothing
        return (kind, value)  # True == 1 == 1.0 as keys: the type tells them apart
    if depth == 0:
        raise TypeError("nested too deep")
    if kind is tuple or kind is list:
        return (kind, *[value_key(item, depth - 1, tensors=tensors) for item in value])
    if tensors and (kind is FakeTensor or (kind in _META_TENSORS and value.device.type == "meta")):
        return _tensor_key(value, kind)
    if python_isinstance(value, dict):
        return (kind, *[value_key(item, depth - 1, tensors=tensors) for item in value.items()])
    if python_isinstance(value, (set, frozenset)):
        if not value:  # a module's _non_persistent_buffers_set: no Counter to build
            return (kind, frozenset())
        # A multiset of the items' keys: two equal helpers in a set are not one.
        counts = Counter(value_key(item, depth - 1, tensors=tensors) for item in value)
        return (kind, frozenset(counts.items()))
    if python_isinstance(value, enum.Enum):
        return value
    if kind is FunctionType and (value.__closure__ or value.__defaults__ or value.__kwdefaults__):
        # What a closure's cells (or its defaults) hold steers the call as much as the code.
        return (value, _function_state(value, depth - 1))
    if python_isinstance(value, _BY_IDENTITY):
        return value
    if python_isinstance(value, (torch.Tensor, nn.Module, MethodType)):
        raise TypeError(f"no key for a {kind.__name__} held here")
    if _state_in_dict(kind):
        # A helper object (an attention processor, a config): by its class and attributes.
        return (kind, value_key(vars(value), depth - 1, tensors=False))
    raise TypeError(f"no key for {kind.__name__}")


def _tensor_key(value: torch.Tensor, kind: type) -> tuple:
    """A fake or plain meta tensor's key: its metadata (see :func:`value_key`)."""
    if kind is FakeTensor and value.constant is not None:
        raise TypeError("a fake tensor with a known value")
    if value.layout is not torch.strided:
        raise TypeError("a tensor of another layout")
    return (
        kind,
        value.shape,
        value.stride(),
        value.storage_offset(),
        value.dtype,
        value.device,
        value.requires_grad,
        value.is_conj(),
        value.is_neg(),
    )


def arguments_key(arguments: Any, module: nn.Module | None) -> tuple[tuple, Any]:
    """``(sameness(arguments, module), value_key(arguments, DEPTH))``, in one walk where it can.

    Asked for every node's and module call's arguments (16,000 times on a 10k-node chain), and
    two walks of the same tree cost twice one. The one walk (:func:`_walk`) takes what most
    arguments are: plain values and fake or meta tensors in exact tuples, lists and dicts (fx's
    immutable dict too: a node's kwargs) with plain keys. It gives ``value_key``'s key, and
    meets the tensors in ``collect_tensors``'s order (items in order, a dict's values, its keys
    being plain); ``value_key`` reaches every tensor ``collect_tensors`` would (a dict costs
    the key two levels of depth and the collection one). Anything else, at any depth, is left
    to the two functions themselves.
    """
    tensors: list[torch.Tensor] = []
    try:
        key = _walk(arguments, DEPTH, tensors)
    except _Unusual:
        return sameness(arguments, module), value_key(arguments, DEPTH)
    return _sameness_of(tensors, module), key


class _Unusual(Exception):
    """An argument :func:`_walk` leaves to ``value_key`` and ``sameness``."""


def _walk(value: Any, depth: int, tensors: list[torch.Tensor]) -> Any:
    """``value_key(value, depth)`` for the arguments :func:`arguments_key` takes, collecting
    their tensors; ``_Unusual`` for anything else."""
    kind = type(value)
    if kind in PLAIN_VALUE_TYPES:
        return (float, value.hex()) if kind is float else (kind, value)
    if depth == 0:
        raise _Unusual
    if kind is tuple or kind is list:
        return (kind, *[_walk(item, depth - 1, tensors) for item in value])
    if kind is dict or kind is immutable_dict:  # a node's kwargs: fx's immutable dict
        if depth == 1:  # value_key keys an item as a tuple, one level down
            raise _Unusual
        return (kind, *[(tuple, _plain(k), _walk(v, depth - 2, tensors)) for k, v in value.items()])
    if kind is FakeTensor or (kind in _META_TENSORS and value.device.type == "meta"):
        tensors.append(value)
        return _tensor_key(value, kind)
    raise _Unusual


def _plain(key: Any) -> Any:
    kind = type(key)
    if kind not in PLAIN_VALUE_TYPES:
        raise _Unusual  # a tensor as a dict key: value_key keys it, collect_tensors does not
    return (float, key.hex()) if kind is float else (kind, key)


def _function_state(function: FunctionType, depth: int) -> tuple:
    """The values a function carries besides its code: its closure's cells and its defaults
    (a cell holding a tensor or a module has no key: ``TypeError``)."""
    cells = tuple(
        value_key(cell.cell_contents, depth, tensors=False) if _cell_filled(cell) else _MISSING_KEY
        for cell in function.__closure__ or ()
    )
    defaults = value_key(function.__defaults__ or (), depth, tensors=False)
    keyword_defaults = value_key(function.__kwdefaults__ or {}, depth, tensors=False)
    return (cells, defaults, keyword_defaults)


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


_MISSING_KEY = ("empty cell",)


def sameness(arguments: tuple, module: nn.Module | None) -> tuple:
    """Which tensors among the arguments are the same object, and which are the module's own
    parameters or buffers: code may branch on ``context is x`` or ``w is self.weight``
    (``nn.MultiheadAttention`` takes its packed path when query, key and value are one
    tensor), which the tensors' metadata does not say."""
    tensors: list[torch.Tensor] = []
    collect_tensors(arguments, tensors, DEPTH)
    return _sameness_of(tensors, module)


def _sameness_of(tensors: list[torch.Tensor], module: nn.Module | None) -> tuple:
    """:func:`sameness` of the tensors it collected, in their order."""
    if not tensors:
        return ()
    own: dict[int, str] = {}
    if module is not None:
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    own[id(tensor)] = name
    first: dict[int, int] = {}
    if not own:  # list comprehensions: a generator costs a frame per item
        return tuple([first.setdefault(id(tensor), index) for index, tensor in enumerate(tensors)])
    return tuple(
        [
            own.get(id(tensor)) or first.setdefault(id(tensor), index)
            for index, tensor in enumerate(tensors)
        ]
    )


def _state_in_dict(kind: type) -> bool:
    """Whether all of an instance's state is its ``__dict__``: a class written in Python with
    no ``__slots__`` and no base but ``object`` written in C (a ``functools.partial``
    keeps its function in C fields, an attention processor keeps its options in vars)."""
    known = _STATE_IN_DICT.get(kind)
    if known is None:
        bases = kind.__mro__[:-1]
        known = kind.__mro__[-1] is object and all(
            base.__flags__ & _HEAP_TYPE and "__slots__" not in vars(base) for base in bases
        )
        _STATE_IN_DICT[kind] = known
    return known


_STATE_IN_DICT: dict[type, bool] = {}
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement


def module_key(module: nn.Module) -> tuple:
    """The state of ``module`` and every module under it (see the glossary).

    Asked for every call of a module whose arguments were seen before, for it and every
    module under it, so the names left out are one set per class (:func:`_skipped_names`)
    and numbers, strings and flags are keyed in the loop.
    """
    kind_of_module = type(module)
    parts: list[Any] = [kind_of_module]
    skipped = _SKIPPED_OF.get(kind_of_module) or _skipped_names(kind_of_module)
    for name, value in vars(module).items():
        if name in skipped:
            continue
        if name in _CALL_HOOKS:
            if value:
                raise TypeError("a module with call hooks")
            continue
        kind = type(value)
        if kind is bool or kind is int or kind is str or value is None:
            parts.append((name, kind, value))
        elif kind is FunctionType and is_recording_wrapper(value):
            parts.append((name, _wrapped_method(module, value)))
        else:
            parts.append((name, value_key(value, DEPTH, tensors=False)))
    for name, tensor in (*module._parameters.items(), *module._buffers.items()):
        parts.append((name, None if tensor is None else _parameter_key(tensor)))
    for name, child in module._modules.items():
        parts.append((name, None if child is None else module_key(child)))
    return tuple(parts)


def _skipped_names(kind: type) -> frozenset[str]:
    """The attributes of a ``kind`` module its key leaves out: the tables (keyed after the
    loop), torch's hook tables that no call runs, and what the class's library reads in no
    call (:func:`_unread_attributes`). Any other name is state, ``skip_hooks`` too."""
    skipped = _SKIPPED_OF[kind] = _TABLES | _STATE_DICT_HOOKS | _unread_attributes(kind)
    return skipped


_SKIPPED_OF: dict[type, frozenset[str]] = {}
_STATE_DICT_HOOKS = frozenset(
    {
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)


def _unread_attributes(kind: type) -> frozenset[str]:
    """Attributes of ``kind`` that no call reads (:data:`_UNREAD`), left out of its key."""
    known = _UNREAD_OF.get(kind)
    if known is None:
        names = [_UNREAD.get((base.__module__, base.__qualname__), ()) for base in kind.__mro__]
        known = _UNREAD_OF[kind] = frozenset().union(*names)
    return known


# Attributes a library keeps for its own bookkeeping and reads in no call, by the class that
# sets them. peft keeps each LoRA layer's construction options in ``kwargs``, its qualified
# name (``target_name``) among them, and reads them nowhere (the test of this module checks
# peft's installed source): every layer would otherwise have a key of its own.
_UNREAD = {("peft.tuners.lora.layer", "LoraLayer"): ("kwargs",)}
_UNREAD_OF: dict[type, frozenset[str]] = {}


def _parameter_key(tensor: torch.Tensor) -> tuple:
    if tensor.device.type != "meta" or tensor.layout is not torch.strided:
        raise TypeError("a parameter off meta")  # outside the analysis view
    return (
        type(tensor),
        tensor.shape,
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.requires_grad,
    )


def _wrapped_method(module: nn.Module, wrapper: FunctionType) -> Any:
    """The tracer's wrapper of one of ``module``'s own methods runs that method on meta:
    keyed by the method's function (each leaf has a wrapper of its own)."""
    original = wrapper.__wrapped__
    if type(original) is not MethodType or original.__self__ is not module:
        raise TypeError("a wrapper of something else")
    return ("method", original.__func__)


def global_state() -> tuple:
    """Torch's global switches an op's result depends on; ``TypeError`` while a global module
    hook is registered (it would run in every module call a repeat skips).

    Asked for every node whose arguments were met before (10k times on a 10k-node chain), so
    torch's queries are bound once, before a trace replaces ``torch.is_autocast_enabled`` and
    Python's ``len`` and ``range`` with Python wrappers that answer these same values here.
    """
    if any(_GLOBAL_HOOKS):
        raise TypeError("a global module hook")
    depth = _function_stack_depth()
    return (
        _is_grad_enabled(),
        _is_inference_mode_enabled(),
        _get_default_dtype(),
        _is_autocast_enabled("cpu"),
        _is_autocast_enabled("cuda"),
        _get_autocast_dtype("cpu"),
        _get_autocast_dtype("cuda"),
        depth,
        tuple([type(_function_mode_at(i)) for i in python_range(depth)]) if depth else (),
    )


_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_get_default_dtype = torch.get_default_dtype
_is_autocast_enabled = torch.is_autocast_enabled
_get_autocast_dtype = torch.get_autocast_dtype
_function_stack_depth = torch._C._len_torch_function_stack
_function_mode_at = torch._C._get_function_stack_at
# The global hook tables (dicts torch fills in place): a non-empty one is a hook.
_GLOBAL_HOOKS = tuple(
    getattr(torch.nn.modules.module, name)
    for name in (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
        "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs",
    )
)


def collect_tensors(tree: Any, found: list[torch.Tensor], depth: int) -> None:
    if python_isinstance(tree, torch.Tensor):
        found.append(tree)
    elif depth and python_isinstance(tree, (tuple, list)):
        for item in tree:
            collect_tensors(item, found, depth - 1)
    elif depth and python_isinstance(tree, dict):
        for item in tree.values():
            collect_tensors(item, found, depth - 1)
