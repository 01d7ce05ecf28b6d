"""Memoised module calls and nodes on meta: a repeated pure run is answered without running.

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
    pure run: a run, under :class:`CallMemo`'s watch, that (a) ran no op the op memo counts as
        impure (a random draw, a data-dependent or non-ATen op: ``OpMemo.impure_ops``) and
        wrote (in place, ``out=``) only into its own intermediates, none of its inputs,
        parameters, buffers or their views (``OpMemo.written``), (b) left the signature as it
        found it (no attribute, container or argument was written), and (c) returned fresh,
        unwritten tensors only:
        fake tensors of this analysis that start their own storage, share it with no input,
        parameter, buffer, fake twin or other output, are a view of nothing but an
        intermediate of the run, need no grad and carry no value or attribute a new fake
        tensor lacks. Its result is then a function of the signature, and a repeat is
        answered with new fake tensors of the recorded metadata; the op records (the ATen ops
        and FLOPs the run added to the node's recorder) are appended again.
    refused signature: one whose watched run was not pure, or that holds something with no
        exact key (a tensor attribute, an object of unknown kind, a hook): it always runs.

In: :func:`call` from the tracer's module calls while it computes a node's meta value
(:meth:`graphsplit.planning.tracing.tracer._Tracer.call_module`) and from the probes'
``call_module`` nodes; :func:`node_run` from every node's meta run
(:meth:`graphsplit.planning.meta.interpreters._MetaInterpreter.run_on_meta`). Out: what a run gives
(fresh objects).

Why above the op memo: a repeated block (70 transformer blocks of an SDXL UNet at two widths)
costs the op memo a dispatch per op and diffusers' and peft's Python around every op, and a
repeated node (10k ``Linear``/``tanh``/``add`` nodes of a chain) its meta contexts and recorder;
the memo answers either at once. A signature's first run is not watched (most occur once: the
key would be paid for nothing); the second is watched and kept, the later ones are answered.
What no key can see (Python globals a library reads, class attributes) is taken to be fixed
during one analysis. Entries live as long as the analysis's op memo (one ``analysis_view``),
so every ``split()`` pays its own.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from types import BuiltinFunctionType, FunctionType, MethodType
from typing import Any

import torch
from torch import nn
from torch._C import _get_dispatch_stack_at, _len_torch_dispatch_stack
from torch._subclasses.fake_tensor import FakeTensor

from graphsplit.planning.patching.leaf_methods import is_recording_wrapper

_META = torch.device("meta")
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
# Exact types whose values are their own key.
_ATOMS = frozenset(
    {
        int,
        float,
        bool,
        str,
        bytes,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
        torch.Size,
    }
)
# Functions and classes held as attributes are keyed by identity (what they are, not state).
_BY_IDENTITY = (FunctionType, BuiltinFunctionType, type)
# Plain tensors on meta (the example inputs' twins) hold no value either.
_META_TENSORS = frozenset({torch.Tensor, nn.Parameter})
_DEPTH = 6  # nesting of plain containers and helper objects a key follows before refusing
# Modes that record ops for a node (the analysis's op recorder registers its class here).
RECORDERS: set[type] = set()
_MISSING = object()
# Python's own, bound at import: while a step is traced ``builtins.isinstance`` is a stand-in
# (planning/patching/traced_builtins.py), and the memo's keys are computed between traced nodes.
_isinstance = isinstance


class CallMemo:
    """One analysis's memoised module calls (see the module docstring)."""

    def __init__(self, op_memo: Any) -> None:
        self.op_memo = op_memo
        self.seen: set[Any] = set()  # (class, arguments) met once: the next one is watched
        self.entries: dict[Any, _Entry | None] = {}  # call signature -> entry; None: refused
        self.nodes: dict[Any, _NodeEntry | None] = {}  # the same for whole nodes
        self.hits = 0
        self.misses = 0


class _Entry:
    """A pure call's answer: its result's template and the op records its run added."""

    __slots__ = ("flops", "ops", "template")

    def __init__(self, template: Any, ops: tuple, flops: int) -> None:
        self.template = template
        self.ops = ops
        self.flops = flops


class _NodeEntry:
    """A pure node's answer: its value's template and its op record (None: not recorded)."""

    __slots__ = ("record", "template")

    def __init__(self, template: Any, record: Any) -> None:
        self.template = template
        self.record = record


class _Tensor:
    """A fresh output tensor in a template: the metadata to make it again."""

    __slots__ = ("device", "dtype", "shape", "stride")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.device = tensor.device


def call(
    memo: CallMemo, module: nn.Module, run: Callable[[], Any], args: tuple, kwargs: dict
) -> Any:
    """``run()`` (which calls ``module(*args, **kwargs)``), or its memoised answer."""
    if not (module._parameters or module._modules):  # an activation, a dropout: cheap to run
        return run()
    # Metadata reads of fake tensors would otherwise go through the meta run's Python modes.
    with torch._C.DisableTorchFunction():
        signature, recorder = _signature(memo, module, args, kwargs)
        entry = memo.entries.get(signature, _MISSING) if signature is not None else None
        if entry is not None and entry is not _MISSING:
            memo.hits += 1
            if recorder is not None:
                recorder.ops.extend(entry.ops)
                recorder.flops += entry.flops
            with torch._C._DisableTorchDispatch():
                return _made(memo, entry.template)
    if entry is None:
        return run()
    return _first_run(memo, signature, recorder, module, run, (args, kwargs))


def node_run(
    memo: CallMemo,
    head: Any,
    module: nn.Module | None,
    record: bool,
    run: Callable[[], tuple[Any, Any]],
    arguments: tuple,
) -> tuple[Any, Any]:
    """``run()`` of one node on meta, ``(value, op record or None)``, or its memoised answer.

    ``head`` names what the node runs (a torch function, a tensor method's name, a module's
    class), ``arguments`` its ``(args, kwargs)`` values; ``module``: the module a
    ``call_module`` node calls, whose state is part of the signature. The same watch as a
    module call's decides whether the node's run was pure; a repeat then costs neither the
    meta contexts nor the recorder.
    """
    with torch._C.DisableTorchFunction():
        signature = _node_signature(memo, head, module, record, arguments)
        entry = memo.nodes.get(signature, _MISSING) if signature is not None else None
        if entry is not None and entry is not _MISSING:
            memo.hits += 1
            with torch._C._DisableTorchDispatch():
                return _made(memo, entry.template), entry.record
    if entry is None:
        return run()
    memo.misses += 1
    impure, writes = memo.op_memo.impure_ops, len(memo.op_memo.written)
    value, op_record = run()
    entry = None
    if memo.op_memo.impure_ops == impure:
        with torch._C.DisableTorchFunction():
            template = _template_if_pure(memo, signature, module, arguments, value, writes)
        if template is not _MISSING:
            entry = _NodeEntry(template, op_record)
    memo.nodes[signature] = entry
    return value, op_record


def _node_signature(
    memo: CallMemo, head: Any, module: nn.Module | None, record: bool, arguments: tuple
) -> Any:
    try:
        described = (head, record, _sameness(arguments, module), _key(arguments, _DEPTH))
    except TypeError:
        return None
    if described not in memo.seen:
        memo.seen.add(described)
        return None
    try:
        state = None if module is None else _module_key(module)
        return (described, state, _global_state())
    except TypeError:
        return None


def _signature(memo: CallMemo, module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``(call signature, the node's op recorder)``; signature None: run the call plainly."""
    try:
        arguments = (
            type(module),
            _sameness((args, kwargs), module),
            _key((args, kwargs), _DEPTH),  # last: the watch compares it again after the run
        )
    except TypeError:
        return None, None
    if arguments not in memo.seen:
        memo.seen.add(arguments)
        return None, None
    try:
        recorder = _recorder(memo)
        return (arguments, _module_key(module), _global_state(), recorder is not None), recorder
    except TypeError:
        return None, None


def _first_run(
    memo: CallMemo,
    signature: tuple,
    recorder: Any,
    module: nn.Module,
    run: Callable[[], Any],
    arguments: tuple,
) -> Any:
    """Run the call under the watch; keep its entry if it was pure, else refuse the signature."""
    memo.misses += 1
    ops, flops = (len(recorder.ops), recorder.flops) if recorder is not None else (0, 0)
    impure, writes = memo.op_memo.impure_ops, len(memo.op_memo.written)
    out = run()
    entry = None
    if memo.op_memo.impure_ops == impure:
        with torch._C.DisableTorchFunction():
            template = _template_if_pure(memo, signature, module, arguments, out, writes)
        if template is not _MISSING:
            if recorder is not None:
                entry = _Entry(template, tuple(recorder.ops[ops:]), recorder.flops - flops)
            else:
                entry = _Entry(template, (), 0)
    memo.entries[signature] = entry
    return out


def _template_if_pure(
    memo: CallMemo,
    signature: tuple,
    module: nn.Module | None,
    arguments: tuple,
    out: Any,
    writes: int,
) -> Any:
    """The result's template if the run left the signature as it was, wrote only into its
    own intermediates (the op memo's ``written`` from index ``writes`` on) and returned fresh
    tensors only, else ``_MISSING``."""
    try:
        unchanged = (
            _key(arguments, _DEPTH) == signature[0][-1]
            and (None if module is None else _module_key(module)) == signature[1]
            and _global_state() == signature[2]
        )
        if not unchanged:
            return _MISSING
        held = _storages_held(memo, module, arguments)
        if any(not held.isdisjoint(reached) for reached in memo.op_memo.written[writes:]):
            return _MISSING  # a write into an input, a parameter or a buffer
        return _template(memo, out, held)
    except TypeError:
        return _MISSING


# -- keys ---------------------------------------------------------------------------------------
def _key(value: Any, depth: int, *, tensors: bool = True) -> Any:
    """An exact, hashable description of an argument or attribute; ``TypeError`` if none.

    Tensors are described by metadata (only fake tensors without a known value and plain
    meta tensors: a real tensor's value could steer Python code); containers by their items;
    helper objects (an attention processor, a config) by their class and attributes.
    ``tensors=False`` (a module's attributes): a tensor has no key, since the call could
    return it, and a fresh copy would not alias it as the run's result does.
    """
    kind = type(value)
    if kind in _ATOMS:
        if kind is float:
            return (float, value.hex())  # -0.0 == 0.0, and nan equals nothing
        return (kind, value)  # True == 1 == 1.0 as keys: the type tells them apart
    if depth == 0:
        raise TypeError("nested too deep")
    if kind is tuple or kind is list:
        return (kind, *[_key(item, depth - 1, tensors=tensors) for item in value])
    if tensors and (kind is FakeTensor or (kind in _META_TENSORS and value.device.type == "meta")):
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
    if _isinstance(value, dict):
        return (kind, *[_key(item, depth - 1, tensors=tensors) for item in value.items()])
    if _isinstance(value, (set, frozenset)):
        # A multiset of the items' keys: two equal helpers in a set are not one.
        counts = Counter(_key(item, depth - 1, tensors=tensors) for item in value)
        return (kind, frozenset(counts.items()))
    if _isinstance(value, enum.Enum):
        return value
    if kind is FunctionType and (value.__closure__ or value.__defaults__ or value.__kwdefaults__):
        # What a closure's cells (or its defaults) hold steers the call as much as the code.
        return (value, _function_state(value, depth - 1))
    if _isinstance(value, _BY_IDENTITY):
        return value
    if _isinstance(value, (torch.Tensor, nn.Module, MethodType)):
        raise TypeError(f"no key for a {kind.__name__} held here")
    if _state_in_dict(kind):
        # A helper object (an attention processor, a config): by its class and attributes.
        return (kind, _key(vars(value), depth - 1, tensors=False))
    raise TypeError(f"no key for {kind.__name__}")


def _function_state(function: FunctionType, depth: int) -> tuple:
    """The values a function carries besides its code: its closure's cells and its defaults
    (a cell holding a tensor or a module has no key: ``TypeError``)."""
    cells = tuple(
        _key(cell.cell_contents, depth, tensors=False) if _cell_filled(cell) else _MISSING_KEY
        for cell in function.__closure__ or ()
    )
    defaults = _key(function.__defaults__ or (), depth, tensors=False)
    keyword_defaults = _key(function.__kwdefaults__ or {}, depth, tensors=False)
    return (cells, defaults, keyword_defaults)


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


_MISSING_KEY = ("empty cell",)


def _sameness(arguments: tuple, module: nn.Module | None) -> tuple:
    """Which tensors among the arguments are the same object, and which are the module's own
    parameters or buffers: code may branch on ``context is x`` or ``w is self.weight``
    (``nn.MultiheadAttention`` takes its packed path when query, key and value are one
    tensor), which the tensors' metadata does not say."""
    tensors: list[torch.Tensor] = []
    _collect_tensors(arguments, tensors, _DEPTH)
    if not tensors:
        return ()
    own: dict[int, str] = {}
    if module is not None:
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is not None:
                own[id(tensor)] = name
    first: dict[int, int] = {}
    return tuple(
        own.get(id(tensor)) or first.setdefault(id(tensor), index)
        for index, tensor in enumerate(tensors)
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


def _module_key(module: nn.Module) -> tuple:
    """The state of ``module`` and every module under it (see the glossary).

    Asked for every call of a module whose arguments were seen before, for it and every
    module under it, so each attribute name's role is looked up once (:func:`_role`) and
    numbers, strings and flags are keyed in the loop.
    """
    parts: list[Any] = [type(module)]
    unread = _unread_attributes(type(module))
    for name, value in vars(module).items():
        role = _ROLES.get(name)
        if role is None:
            role = _role(name)
        if role is _SKIPPED or (unread and name in unread):
            continue
        if role is _CALL_HOOK:
            if value:
                raise TypeError("a module with call hooks")
            continue
        kind = type(value)
        if kind is bool or kind is int or kind is str or value is None:
            parts.append((name, kind, value))
        elif kind is FunctionType and is_recording_wrapper(value):
            parts.append((name, _wrapped_method(module, value)))
        else:
            parts.append((name, _key(value, _DEPTH, tensors=False)))
    for name, tensor in (*module._parameters.items(), *module._buffers.items()):
        parts.append((name, None if tensor is None else _parameter_key(tensor)))
    for name, child in module._modules.items():
        parts.append((name, None if child is None else _module_key(child)))
    return tuple(parts)


def _role(name: str) -> object:
    """What an attribute name is to the key: a table or state-dict hook table (skipped: the
    tables are keyed below, those hooks play no part in a call), a call hook table, or state."""
    if name in _TABLES:
        role = _SKIPPED
    elif name in _CALL_HOOKS:
        role = _CALL_HOOK
    elif name in _STATE_DICT_HOOKS:
        role = _SKIPPED
    else:
        role = _STATE
    _ROLES[name] = role
    return role


_SKIPPED, _CALL_HOOK, _STATE = object(), object(), object()
# torch's own hook tables that no call runs (any other name is state, ``skip_hooks`` too).
_STATE_DICT_HOOKS = frozenset(
    {
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)
_ROLES: dict[str, object] = {}


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


def _global_state() -> tuple:
    """Torch's global switches an op's result depends on; ``TypeError`` while a global module
    hook is registered (it would run in every module call a repeat skips)."""
    if any(map(len, _GLOBAL_HOOKS)):
        raise TypeError("a global module hook")
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.get_default_dtype(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cpu"),
        torch.get_autocast_dtype("cuda"),
        torch._C._len_torch_function_stack(),
        tuple(
            type(torch._C._get_function_stack_at(i))
            for i in range(torch._C._len_torch_function_stack())
        ),
    )


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


def _recorder(memo: CallMemo) -> Any:
    """The node's op recorder, or None; the dispatch modes must be the analysis's own.

    A call outside the analysis's meta execution (a real run of the example batch) or under
    any other mode is refused.
    """
    depth = _len_torch_dispatch_stack()
    if depth < 2 or _get_dispatch_stack_at(1) is not memo.op_memo:
        raise TypeError("not the analysis's meta execution")
    if depth == 2:
        return None
    recorder = _get_dispatch_stack_at(2)
    if depth > 3 or type(recorder) not in RECORDERS:
        raise TypeError("an unknown dispatch mode")
    return recorder


# -- results ------------------------------------------------------------------------------------
def _storages_held(memo: CallMemo, module: nn.Module | None, arguments: Any) -> set[Any]:
    """What a fresh result must not share: the storages of the arguments, of the parameters
    and buffers under ``module`` and of their fake twins (the fake mode's converter made
    them: a view of a twin is a view of the tensor), and those tensors themselves (a view of
    a plain meta tensor has it as its base, on a storage of the fake mode's)."""
    tensors: list[torch.Tensor] = []
    _collect_tensors(arguments, tensors, _DEPTH)
    for child in module.modules() if module is not None else ():
        tensors.extend(
            t for t in (*child._parameters.values(), *child._buffers.values()) if t is not None
        )
    converter = memo.op_memo.fake_mode.fake_tensor_converter
    held: set[Any] = set()
    for tensor in tensors:
        held.add(_storage(tensor))
        held.add(("tensor", id(tensor)))  # a view's base may be the tensor itself
        twin = converter._get_memo(tensor) if type(tensor) is not FakeTensor else None
        if twin is not None:
            held.add(_storage(twin))
    return held


def _collect_tensors(tree: Any, found: list[torch.Tensor], depth: int) -> None:
    if _isinstance(tree, torch.Tensor):
        found.append(tree)
    elif depth and _isinstance(tree, (tuple, list)):
        for item in tree:
            _collect_tensors(item, found, depth - 1)
    elif depth and _isinstance(tree, dict):
        for item in tree.values():
            _collect_tensors(item, found, depth - 1)


def _storage(tensor: torch.Tensor) -> int:
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return tensor.untyped_storage()._cdata


def _template(memo: CallMemo, out: Any, held: set[Any]) -> Any:
    """What to build a repeat's result from; ``TypeError`` unless every tensor is fresh."""
    kind = type(out)
    if kind in _ATOMS:
        return out
    if kind is tuple or kind is list:
        return (kind, [_template(memo, item, held) for item in out])
    if kind is dict:
        return (kind, [(key, _template(memo, item, held)) for key, item in out.items()])
    if kind is FakeTensor and _fresh(memo, out, held):
        held.add(_storage(out))  # a second output on the same storage is no longer fresh
        return _Tensor(out)
    raise TypeError(f"a result the memo cannot remake ({kind.__name__})")


def _fresh(memo: CallMemo, tensor: FakeTensor, held: set[Any]) -> bool:
    attributes = memo.op_memo.fake_attributes
    if tensor.fake_mode is not memo.op_memo.fake_mode or attributes is None:
        return False
    if dict(vars(tensor), _fake_device=None) != attributes:
        return False  # a known value, a memoised item() or nonzero(), an attribute of its own
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        storage = tensor.untyped_storage()
        expected = torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_META
        )
        return (
            tensor._version == 0  # no write into it either
            and not tensor.requires_grad
            and tensor.layout is torch.strided
            and tensor.storage_offset() == 0
            and not tensor.is_conj()
            and not tensor.is_neg()
            and storage._cdata not in held
            and storage.nbytes() == expected.untyped_storage().nbytes()
            and (not tensor._is_view() or _fresh_base(tensor._base, held))
        )


def _fresh_base(base: torch.Tensor, held: set[Any]) -> bool:
    """A view is fresh when its base is: an intermediate of the run (``linear`` on a 3-d
    input views the matmul's 2-d result), no input, parameter or buffer."""
    if type(base) is not FakeTensor or ("tensor", id(base)) in held:
        return False
    return base.untyped_storage()._cdata not in held


def _made(memo: CallMemo, template: Any) -> Any:
    """A new result from ``template`` (call with torch functions and dispatch disabled)."""
    kind = type(template)
    if kind is _Tensor:
        elem = torch.empty_strided(
            template.shape, template.stride, dtype=template.dtype, device=_META
        )
        return memo.op_memo.new_fake(elem, template.device)
    if kind is tuple:
        container, items = template
        if container is dict:
            return {key: _made(memo, item) for key, item in items}
        made = [_made(memo, item) for item in items]
        return made if container is list else tuple(made)
    return template
