"""Memoised module calls and nodes on meta: a repeated pure run is answered without running.

Glossary:
    call signature: what a module call's (or a node's) result on meta can depend on, as an
        exact key (:mod:`graphsplit.planning.meta.call_signature`).
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

In: :func:`replay_or_call_module` from the tracer's module calls while it computes a node's
meta value (:meth:`graphsplit.planning.tracing.tracer._Tracer.call_module`) and from the
probes' ``call_module`` nodes (both through
:func:`~graphsplit.planning.meta.analysis_view.module_called`); :func:`replay_or_run_node`
from every node's meta run
(:meth:`graphsplit.planning.meta.meta_interpreter.MetaInterpreter.run_on_meta`). Out: what a
run gives (fresh objects).

Why above the op memo: a repeated block (70 transformer blocks of an SDXL UNet at two widths)
costs the op memo a dispatch per op and diffusers' and peft's Python around every op, and a
repeated node (10k ``Linear``/``tanh``/``add`` nodes of a chain) its meta contexts and recorder;
the memo answers either at once. A signature's first run is not watched (most occur once: the
key would be paid for nothing); the second is watched and kept, the later ones are answered.
What no key can see (Python globals a library reads, class attributes) is taken to be fixed
during one split. Entries hold metadata only and live as long as the split's planner
(:mod:`graphsplit.planning.meta.shared_memos`): a round or a later shape signature's plan
reads what earlier analyses kept, and every ``split()`` pays its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._C import _get_dispatch_stack_at, _len_torch_dispatch_stack
from torch._subclasses.fake_tensor import FakeTensor

from graphsplit.planning.meta.call_signature import (
    DEPTH,
    arguments_key,
    collect_tensors,
    global_state,
    module_key,
    value_key,
)
from graphsplit.planning.meta.shared_memos import SharedMemos
from graphsplit.planning.patching.originals import PLAIN_VALUE_TYPES

_META = torch.device("meta")
# Modes that record ops for a node (the analysis's op recorder registers its class here).
RECORDERS: set[type] = set()
_MISSING = object()


class CallMemo:
    """One analysis's memoised module calls (see the module docstring)."""

    def __init__(self, op_memo: Any) -> None:
        self.op_memo = op_memo
        # One split's tables (shared_memos), or tables of its own.
        shared = getattr(op_memo, "shared", None) or SharedMemos()
        self.seen: set[Any] = shared.seen  # (class, arguments) met once: the next is watched
        # call signature -> entry; None: refused
        self.entries: dict[Any, _Entry | None] = shared.call_entries
        self.nodes: dict[Any, _NodeEntry | None] = shared.node_entries  # the same for nodes
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


def replay_or_call_module(
    memo: CallMemo, module: nn.Module, call: Callable[[], Any], args: tuple, kwargs: dict
) -> Any:
    """``call()`` (which calls ``module(*args, **kwargs)`` on meta), or its memoised answer."""
    if not (module._parameters or module._modules):  # an activation, a dropout: cheap to run
        return call()
    # Metadata reads of fake tensors would otherwise go through the meta run's Python modes.
    with torch._C.DisableTorchFunction():
        signature, recorder = _call_signature(memo, module, args, kwargs)
        entry = memo.entries.get(signature, _MISSING) if signature is not None else None
        if entry is not None and entry is not _MISSING:
            memo.hits += 1
            if recorder is not None:
                recorder.ops.extend(entry.ops)
                recorder.flops += entry.flops
            with torch._C._DisableTorchDispatch():
                return _made(memo, entry.template)
    if entry is None:
        return call()
    ops, flops = (len(recorder.ops), recorder.flops) if recorder is not None else (0, 0)
    watch = _watch(memo)
    out = call()
    template = _template_if_pure(memo, watch, signature, module, (args, kwargs), out)
    entry = None
    if template is not _MISSING:
        if recorder is not None:
            entry = _Entry(template, tuple(recorder.ops[ops:]), recorder.flops - flops)
        else:
            entry = _Entry(template, (), 0)
    memo.entries[signature] = entry
    return out


def replay_or_run_node(
    memo: CallMemo,
    head: Any,
    module: nn.Module | None,
    record: bool,
    run_on_meta: Callable[[], tuple[Any, Any]],
    arguments: tuple,
) -> tuple[Any, Any]:
    """``run_on_meta()`` of one node, ``(value, op record or None)``, or its memoised answer.

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
        return run_on_meta()
    watch = _watch(memo)
    value, op_record = run_on_meta()
    template = _template_if_pure(memo, watch, signature, module, arguments, value)
    memo.nodes[signature] = None if template is _MISSING else _NodeEntry(template, op_record)
    return value, op_record


def _node_signature(
    memo: CallMemo, head: Any, module: nn.Module | None, record: bool, arguments: tuple
) -> Any:
    """A node's signature; None: run it plainly (the arguments' first meeting, or no key)."""
    try:
        described = (head, record, *arguments_key(arguments, module))
    except TypeError:
        return None
    if described not in memo.seen:
        memo.seen.add(described)
        return None
    try:
        state = None if module is None else module_key(module)
        return (described, state, global_state())
    except TypeError:
        return None


def _call_signature(
    memo: CallMemo, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[Any, Any]:
    """``(call signature, the node's op recorder)``; signature None: run the call plainly."""
    try:
        # The value key last: the watch compares it again after the run.
        arguments = (type(module), *arguments_key((args, kwargs), module))
    except TypeError:
        return None, None
    if arguments not in memo.seen:
        memo.seen.add(arguments)
        return None, None
    try:
        recorder = _recorder(memo)
        return (arguments, module_key(module), global_state(), recorder is not None), recorder
    except TypeError:
        return None, None


def _watch(memo: CallMemo) -> tuple[int, int]:
    """Start watching a run (a signature's second, kept if pure): the op memo's counts."""
    memo.misses += 1
    return memo.op_memo.impure_ops, len(memo.op_memo.written)


def _template_if_pure(
    memo: CallMemo,
    watch: tuple[int, int],
    signature: tuple,
    module: nn.Module | None,
    arguments: tuple,
    out: Any,
) -> Any:
    """The result's template if the run watched since ``watch`` was pure: it ran no impure
    op, left the signature as it was, wrote only into its own intermediates (the op memo's
    ``written`` past the watch's count) and returned fresh tensors only; else ``_MISSING``."""
    impure, writes = watch
    if memo.op_memo.impure_ops != impure:
        return _MISSING
    with torch._C.DisableTorchFunction():
        try:
            unchanged = (
                value_key(arguments, DEPTH) == signature[0][-1]
                and (None if module is None else module_key(module)) == signature[1]
                and global_state() == signature[2]
            )
            if not unchanged:
                return _MISSING
            held = _storages_held(memo, module, arguments)
            if any(not held.isdisjoint(reached) for reached in memo.op_memo.written[writes:]):
                return _MISSING  # a write into an input, a parameter or a buffer
            return _template(memo, out, held)
        except TypeError:
            return _MISSING


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
    collect_tensors(arguments, tensors, DEPTH)
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


def _storage(tensor: torch.Tensor) -> int:
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return tensor.untyped_storage()._cdata


def _template(memo: CallMemo, out: Any, held: set[Any]) -> Any:
    """What to build a repeat's result from; ``TypeError`` unless every tensor is fresh."""
    kind = type(out)
    if kind in PLAIN_VALUE_TYPES:
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
