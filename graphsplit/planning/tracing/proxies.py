"""The proxies of a step's trace: traced values that answer Python as their meta value would.

Glossary:
    traced value: a proxy of the step's tracer whose node carries ``node.meta["val"]``, the
        value eager would hold in its place (:meth:`TracedValue.eager_value`).
    traced attribute: ``proxy.name``, a method call if called, else a ``getattr`` node created
        only when the attribute is used as a value.
    value read: ``bool(x)``, ``int(x)``, ``x.item()``, ``x.tolist()`` on a traced tensor;
        answered from frozen data where the planning can (planning/opaque/value_reads.py),
        else refused by the tracer.

    size text: ``str(w)`` / ``f"block_{w}"`` of a traced number: its text, recorded by the
        tracer and made a guard once a string holding it reaches a node (a module's argument),
        so stage code rechecks it (planning/rules/size_guards.py).

In: a node and its tracer (:class:`graphsplit.planning.tracing.tracer.StepTracer`). Out: the
proxy types the tracer creates, and those the patched builtins recognise; the refusal of a
traced size used as a Python dict key; the size texts a node's arguments hold:

    TracedValue(node, tracer): fx.Proxy
    PLAIN_ARGUMENTS: {type: handler}                    # the tracer's create_arg by exact type
    TracedAttribute(root, attr): TracedValue
    dict_view_items(obj) -> list | None                 # iterating a traced dict's view
    refuse_a_size_as_key(error: KeyError) -> None      # raises SplitError for a traced key
    texts_reaching(texts, arguments) -> list[Guard]     # taken out of ``texts``
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list

from graphsplit.artifacts import Guard
from graphsplit.errors import Fix, SplitError, TraceError, user_error
from graphsplit.planning.opaque.value_reads import NOT_ANSWERED, Read, answer
from graphsplit.planning.patching.originals import python_len
from graphsplit.planning.rules.size_guards import Formatted
from graphsplit.planning.rules.user_lines import describe, frame_location_of, is_internal

__all__ = [
    "DTYPE_READ",
    "PLAIN_ARGUMENTS",
    "TracedAttribute",
    "TracedValue",
    "refuse_a_size_as_key",
    "texts_reaching",
]

_STATIC_TENSOR_ATTRIBUTES = frozenset({"dtype", "is_floating_point", "is_complex"})
DTYPE_READ = "dtype_read"  # node.meta key: the step's Python read this node's dtype
_OWN_ATTRIBUTES = frozenset({"node", "_node", "root", "attr", "tracer"})
_METHOD_READS = {"tolist": Read.TOLIST, "item": Read.ITEM}


class TracedValue(fx.Proxy):
    """A proxy that answers Python's questions the way its meta value would.

    - ``isinstance``, ``callable`` and ``len`` answer from :meth:`eager_value` (see
      :mod:`graphsplit.planning.patching.traced_builtins`): library code that branches on them
      (DiffSynth's ``transfer_data_to_device`` casts only tensors; einops picks its torch
      backend; transformers calls a check's condition if it is callable) must run the
      program eager runs;
    - ``bool``, ``int``, ``float``, ``__index__`` (a slice bound, ``[0] * n``) and ``len``
      called from C code read the meta value and record a guard (see
      :meth:`graphsplit.planning.tracing.tracer.StepTracer.concrete`);
    - ``round()`` and ``divmod()`` stay traced, as ``//`` and ``%`` do.
    """

    def __getattr__(self, name: str) -> Any:
        if name in _OWN_ATTRIBUTES:  # not set yet (during construction): never a graph node
            raise AttributeError(name)
        value = self.node.meta.get("val")
        if isinstance(value, torch.Tensor):
            if name in _STATIC_TENSOR_ATTRIBUTES:
                # A traced op's dtype is fixed by the trace; code such as torch.finfo(x.dtype)
                # needs the real object. The analysis's dtype, which an autocast around the
                # split may not share: noted, and checked against a real run (ambient_dtypes).
                if name == "dtype":
                    self.node.meta[DTYPE_READ] = True
                return getattr(value, name)
            if name.startswith("_") and not hasattr(value, name):
                # Probes such as Parameter's isinstance check (getattr(x, "_is_param", False))
                # must see what a tensor says: no such attribute.
                raise AttributeError(name)
        return TracedAttribute(self, name)

    def eager_value(self) -> Any:
        """The value eager would hold here: the node's meta value."""
        return self.node.meta.get("val")

    def __len__(self) -> int:
        return self.tracer.concrete(self, python_len)

    def __int__(self) -> int:
        return self.tracer.concrete(self, int)

    def __float__(self) -> float:
        return self.tracer.concrete(self, float)

    def __index__(self) -> int:
        return self.tracer.concrete(self, operator.index, pending=True)

    def __iter__(self) -> Iterator[Any]:
        return self.tracer.iter(self)

    def __str__(self) -> str:
        """``str(w)`` of a size: its text, a guarded value (fx's ``Proxy(name)`` otherwise,
        which a module given ``"block_" + str(w)`` would silently receive)."""
        if _is_number(self.eager_value()):
            return self.tracer.concrete(self, str)
        return repr(self)

    def __format__(self, spec: str) -> str:
        """``f"block_{w}"`` of a size: its text, a guarded value (see :meth:`__str__`)."""
        if _is_number(self.eager_value()):
            return self.tracer.concrete(self, Formatted(spec))
        return object.__format__(self, spec)

    def __setitem__(self, key: Any, value: Any) -> None:
        # Recorded in place, then rewritten as a copy by inplace.functionalize_inplace.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def _augmented(self, method: str, operation: Callable[[Any, Any], Any], other: Any) -> Any:
        """``h += 1``: in place on a tensor (as eager does), a new value for a Python number."""
        if isinstance(self.node.meta.get("val"), torch.Tensor):
            return self.tracer.create_proxy("call_method", method, (self, other), {})
        return self.tracer.create_proxy("call_function", operation, (self, other), {})

    def __iadd__(self, other: Any) -> Any:
        return self._augmented("add_", operator.add, other)

    def __isub__(self, other: Any) -> Any:
        return self._augmented("sub_", operator.sub, other)

    def __imul__(self, other: Any) -> Any:
        return self._augmented("mul_", operator.mul, other)

    # Python calls these on its own (``round(h / 8)``, ``q, r = divmod(n, 4)``); fx's Proxy
    # lacks them, so they raised a bare TypeError from the user's line. Traced: the number
    # stays a node, as ``//`` and ``%`` do.
    def __round__(self, ndigits: Any = None) -> Any:
        args = (self,) if ndigits is None else (self, ndigits)
        return self.tracer.create_proxy("call_function", round, args, {})

    def __divmod__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", divmod, (self, other), {})

    def __rdivmod__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", divmod, (other, self), {})

    def __itruediv__(self, other: Any) -> Any:
        return self._augmented("div_", operator.truediv, other)

    def __ifloordiv__(self, other: Any) -> Any:
        return self._augmented("floor_divide_", operator.floordiv, other)

    def __ipow__(self, other: Any) -> Any:
        return self._augmented("pow_", operator.pow, other)


def _is_number(value: Any) -> bool:
    """A Python number or a tuple of them (a ``torch.Size``): what a size's text shows."""
    if isinstance(value, tuple):
        return all(type(item) in (int, float, bool) for item in value)
    return type(value) in (int, float, bool)


class TracedAttribute(TracedValue):
    """``proxy.name``: a method call if called, else a lazily created ``getattr`` node."""

    def __init__(self, root: TracedValue, attr: str) -> None:
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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        read = _METHOD_READS.get(self.attr)
        reads_value = read is not None and not args and not kwargs  # x.tolist(), x.item()
        if reads_value and isinstance(self.root.eager_value(), torch.Tensor):
            answered = answer(self.tracer, self.root, read)
            if answered is not NOT_ANSWERED:
                return answered  # frozen data, one sample per batch (value_reads.py)
        return self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs)

    def eager_value(self) -> Any:
        """The attribute of the root's meta value, without creating a node for it."""
        if self._node is not None:
            return self._node.meta.get("val")
        return getattr(self.root.eager_value(), self.attr, None)


def _proxy_node(tracer: fx.Tracer, proxy: TracedValue) -> fx.Node:
    return proxy.node


# ``StepTracer.create_arg``'s handler by exact type: the tracer's proxies give their node, and
# a value of a plain type goes straight to torch.fx's own handler of that type (its
# ``_create_arg_bypass``, what ``TracerBase.create_arg`` calls first). fx's ``Tracer.create_arg``
# asks seven questions of every argument before it gets there (a parameter, tensor or module
# of the root? a named tuple? a tensor constant? an opaque type? a proxyable class?), each a
# call of the trace's ``isinstance``; for these exact types every answer is no: they are not
# tensors, modules or named tuples, and torch refuses to register a builtin type or a pytree
# node type (fx's immutable containers) as opaque. About 20,000 arguments on a 10k-node chain.
PLAIN_ARGUMENTS: dict[type, Callable[[fx.Tracer, Any], Any]] = {
    TracedValue: _proxy_node,
    TracedAttribute: _proxy_node,
    **{
        kind: fx.proxy._create_arg_bypass[kind]
        for kind in (tuple, list, dict, immutable_list, immutable_dict, int, float, bool, str)
    },
    type(None): fx.proxy._create_arg_bypass[type(None)],
}

_DICT_VIEWS = {"items", "values", "keys"}


def dict_view_items(obj: TracedValue) -> list[Any] | None:
    """What a ``for`` over ``d.items()`` / ``d.values()`` / ``d.keys()`` of a traced dict
    ``d`` (a module's dict of outputs) iterates: ``(key, d[key])`` pairs, ``d[key]`` values or
    the keys, each value a ``getitem`` node of ``d``, as eager iterates the view; ``None``
    for any other value."""
    node = obj.node
    if node.op != "call_method" or node.target not in _DICT_VIEWS or len(node.args) != 1:
        return None
    mapping = node.args[0]
    if not isinstance(mapping, fx.Node) or not isinstance(mapping.meta.get("val"), dict):
        return None
    traced = obj.tracer.proxy(mapping)
    keys = list(mapping.meta["val"].keys())
    if node.target == "keys":
        return keys
    if node.target == "values":
        return [traced[key] for key in keys]
    return [(key, traced[key]) for key in keys]


def refuse_a_size_as_key(error: KeyError) -> None:
    """A traced size looked up in a Python dict (``table[h.shape[-1]]``) is not found: the
    key is a proxy, not the number. Refused at the user's line (a lookup that worked would
    bake the entry in unchecked)."""
    key = error.args[0] if error.args else None
    if not isinstance(key, TracedValue) or isinstance(key.eager_value(), torch.Tensor):
        return
    traceback, place = error.__traceback__, None
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if not is_internal(code.co_filename):
            place = frame_location_of(code.co_filename, traceback.tb_lineno)
        traceback = traceback.tb_next
    raise user_error(
        SplitError,
        f"the step looks a traced value ({key.eager_value()!r} at this size, read from a "
        "tensor's shape) up in a Python dict or set; graphsplit cannot recheck such a lookup "
        "at another size.",
        source=describe(place) if place is not None else None,
        fix=Fix(
            "look the value up outside the step (in the data pipeline, passing the result as "
            "an input), or hold the table as a tensor and index it with a tensor"
        ),
    ) from error


def refuse_traced_text(error: TypeError, example_values: dict[str, Any]) -> None:
    """A batch field of strings (a list of prompts) is traced, item by item: code that needs
    the real text (a tokenizer's Rust core) raises ``TypeError`` on a traced item. Refused as
    a ``TraceError`` at the step's line that passed it (``path="auto"`` then tries the
    module-level path), not left as the library's bare error."""
    leaves = torch.utils._pytree.tree_leaves(example_values)
    if not any(isinstance(leaf, str) for leaf in leaves):
        return
    traceback, place, outer = error.__traceback__, None, None
    innermost = traceback
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    if innermost is None or not _holds_traced_text(innermost.tb_frame.f_locals):
        return  # the code that raised was handed no traced text: another TypeError
    while traceback is not None:
        name = traceback.tb_frame.f_code.co_filename
        if not is_internal(name):
            here = frame_location_of(name, traceback.tb_lineno)
            place = here
            outer = here if "site-packages" not in name else outer
        traceback = traceback.tb_next
    place = outer or place
    raise user_error(
        TraceError,
        f"the step passed a batch field of strings to code that needs the real text ({error}); "
        "graphsplit traces a batch's strings, so it cannot run that code while tracing.",
        source=describe(place) if place is not None else None,
        fix=Fix(
            "tokenize in the data pipeline (the collate function) and pass the token ids to "
            "the step, which then encodes them traced and cacheable"
        ),
    ) from error


def _holds_traced_text(names: dict[str, Any]) -> bool:
    """Whether a frame's locals hold a traced batch string (or a list of them), directly or
    one container deep: what code that needs the real text was handed. Told by the proxy's
    type and its meta value, so a ``TypeError`` of other code in a step whose batch also
    holds strings keeps its own message."""
    for value in names.values():
        kind = type(value)
        items = value.values() if issubclass(kind, dict) else value
        for item in items if issubclass(kind, (list, tuple, dict)) else (value,):
            if issubclass(type(item), TracedValue) and _is_text(item.node.meta.get("val")):
                return True
    return False


def _is_text(value: Any) -> bool:
    if issubclass(type(value), (list, tuple)):  # fx keeps a list as its immutable_list
        return any(issubclass(type(item), str) for item in value)
    return issubclass(type(value), str)


def texts_reaching(texts: list[Guard], arguments: Any) -> list[Guard]:
    """Take from ``texts`` (``str()`` / ``format()`` reads of sizes) those whose text is in
    a string among ``arguments`` of a node being created: a string that reaches a module or
    an op is a value of the plan, rechecked at run time. Text that stays in Python (a cache
    key, a log message) changes nothing the plan computes and is not checked."""
    strings = [leaf for leaf in torch.utils._pytree.tree_leaves(arguments) if type(leaf) is str]
    reached = [guard for guard in texts if any(guard.value in text for text in strings)]
    texts[:] = [guard for guard in texts if guard not in reached]
    return reached
