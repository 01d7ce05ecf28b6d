"""Memoised fake-tensor results: each ATen op signature is computed once per analysis.

Glossary:
    op signature: an ATen overload with the metadata of its tensor arguments (shape, stride,
        storage offset, dtype, device, layout) and the values of its other arguments. A model's
        repeated blocks (28 transformer layers, 24 T5 blocks) run the same few hundred
        signatures thousands of times.
    memoisable op: one whose outputs are fresh tensors fully described by the signature: no
        view or in-place op (their outputs alias or mutate an input, and in-place ops move
        version counters the analysis reads), no random op, no op whose output shape or value
        depends on data, no constant-carrying output (a fake tensor that remembers its value).

    fake twin: the fake tensor the fake mode substitutes for a meta parameter or buffer when
        an op first reads it (once per tensor and analysis: the fake mode's converter memoises
        it). :meth:`OpMemo.fake_twin` makes the common case (a leaf tensor that is the only
        view of its own storage) directly and records it in the converter's memos, exactly
        where the converter would; anything else goes through the converter.
    quick construction: a fake tensor made by ``Tensor._make_subclass`` plus the attribute
        dictionary every new ``FakeTensor`` gets, instead of ``FakeTensor.__new__``'s argument
        checking (most of the cost of a memo hit). :class:`OpMemo` checks once, on a probe,
        that both give the same tensor (type, dispatch keys, attributes) and otherwise uses
        the constructor: a torch release that adds a field only makes it slower.

Why not torch's own cache: ``FakeTensorMode`` does cache dispatch results (and it is on), but
its hit path rebuilds a hash key through pytree for every argument and re-validates the entry;
the analysis spends most of its time there. This mode sits just above the analysis's fake mode
(below the op recorder, which still sees every op) and answers a repeated signature with new
fake tensors of the recorded metadata, at a fraction of the cost. An :class:`OpMemo` lives as
long as its fake mode; its table of results (metadata only) is one split's
(:mod:`graphsplit.planning.meta.shared_memos`): the rounds of a plan and the plans of later
shape signatures read what the earlier analyses ran, and every ``split()`` pays its own first
runs.

Every op of a meta run passes this mode on its way to the fake mode, so it is also where an op
that reads tensor values is told apart by type
(:func:`~graphsplit.planning.meta.meta_failures.run_value_reading_op`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphsplit.planning.meta.call_memo import CallMemo
from graphsplit.planning.meta.meta_failures import reads_values, run_value_reading_op
from graphsplit.planning.meta.shared_memos import SharedMemos
from graphsplit.planning.patching.originals import PLAIN_VALUE_TYPES

_META = torch.device("meta")
_DEVICE = torch.ops.prim.device.default  # the most frequent op: asked for first
_UNSAFE_TAGS = frozenset(
    {
        torch.Tag.nondeterministic_seeded,
        torch.Tag.dynamic_output_shape,
        torch.Tag.data_dependent_output,
        torch.Tag.inplace_view,
    }
)
# Views in all but schema: their output shares the input's storage (and version counter).
_VIEWS_IN_DISGUISE = frozenset({torch.ops.aten._unsafe_view.default})
# Whether an overload's results may be memoised, decided once per overload.
_MEMOISABLE: dict[Any, bool] = {}


def _memoisable(func: Any) -> bool:
    known = _MEMOISABLE.get(func)
    if known is None:
        known = _MEMOISABLE[func] = (
            _fresh_tensor_results(func)
            and all(ret.alias_info is None for ret in func._schema.returns)
            and func not in _VIEWS_IN_DISGUISE
        )
    return known


def _fresh_tensor_results(func: Any) -> bool:
    """What a memoisable op and a memoisable view share: an ATen overload that writes nothing,
    returns tensors only, and is neither random nor data-dependent (:data:`_UNSAFE_TAGS`)."""
    schema = func._schema
    return (
        isinstance(func, torch._ops.OpOverload)
        and not schema.is_mutable
        and len(schema.returns) > 0
        and all(ret.type.isSubtypeOf(torch._C.TensorType.get()) for ret in schema.returns)
        and not _UNSAFE_TAGS.intersection(func.tags)
        and schema.name.split("::")[0] == "aten"
    )


def _impure(func: Any) -> bool:
    """An op whose effect is more than fresh outputs of its inputs' metadata, or unknown:
    it draws random numbers, reads tensor data, or is no ATen op. Writes are told apart
    (:func:`_written_arguments`): a write into the run's own intermediates is no effect."""
    known = _IMPURE.get(func)
    if known is None:
        known = (
            not isinstance(func, torch._ops.OpOverload)
            or bool(_UNSAFE_TAGS.intersection(func.tags))
            or func._schema.name.split("::")[0] != "aten"
            or (func._schema.is_mutable and _written_arguments(func) is None)
        )
        _IMPURE[func] = known
    return known


_IMPURE: dict[Any, bool] = {}


def _written_arguments(func: Any) -> tuple[tuple[int, str], ...] | None:
    """``(position, name)`` of each argument a mutating op writes (``add_``'s ``self``,
    ``out=``), from its schema; None when a written argument is not a plain tensor."""
    known = _WRITTEN.get(func, _MISSING)
    if known is _MISSING:
        written = []
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                if not argument.type.isSubtypeOf(torch._C.TensorType.get()):
                    written = None
                    break
                written.append((position, argument.name))
        known = _WRITTEN[func] = None if written is None else tuple(written)
    return known


_WRITTEN: dict[Any, Any] = {}


def _identities(tensor: torch.Tensor) -> frozenset[Any]:
    """What a write into ``tensor`` reaches: the tensor, its storage, and its view's base."""
    found = [("tensor", id(tensor)), tensor.untyped_storage()._cdata]
    if tensor._is_view():
        base = tensor._base
        found += [("tensor", id(base)), base.untyped_storage()._cdata]
    return frozenset(found)


def _memoisable_view(func: Any) -> bool:
    """A view of its first argument (``view``, ``t``, ``transpose``, ``expand``, ...)."""
    known = _MEMOISABLE_VIEW.get(func)
    if known is None:
        known = _MEMOISABLE_VIEW[func] = (
            isinstance(func, torch._ops.OpOverload)
            and func.is_view
            and len(func._schema.returns) == 1
            and func._schema.arguments[0].alias_info is not None
            and _fresh_tensor_results(func)
        )
    return known


_MEMOISABLE_VIEW: dict[Any, bool] = {}


def _key_of(value: Any) -> Any:
    """A hashable description of one argument, or raise ``TypeError`` if there is none.

    Runs for every argument of every memoisable op, so the common types are tested by exact
    type first (a set lookup) and tensors read only what identifies their metadata.
    """
    kind = type(value)
    if kind in PLAIN_VALUE_TYPES:
        return (kind, value)
    if kind is tuple or kind is list:
        return (kind, tuple([_key_of(item) for item in value]))
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided or value.dtype.is_complex:
            raise TypeError("not a strided real tensor")  # (complex: conj/neg bits)
        return (
            kind,
            value.dtype,
            value.device,
            value.shape,
            value.stride(),
            value.storage_offset(),
        )
    if isinstance(value, _PLAIN_VALUE_CLASSES):  # a subclass (an IntEnum): by type and value
        return (kind, value)
    if isinstance(value, (list, tuple)):
        return (kind, tuple(_key_of(item) for item in value))
    raise TypeError(f"no key for {kind.__name__}")


_PLAIN_VALUE_CLASSES = tuple(PLAIN_VALUE_TYPES)


class OpMemo(TorchDispatchMode):
    """Answers repeated op signatures with fresh fake tensors; see the module docstring."""

    def __init__(self, fake_mode: FakeTensorMode, shared: SharedMemos | None = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        # signature -> tuple of (shape, stride, dtype, device) per output; None: do not memoise
        self.results: dict[Any, tuple | None] = {} if shared is None else shared.op_results
        self.hits = 0
        self.misses = 0
        # Ops that may write, draw, read data or do what the memo cannot see: the module-call
        # memo refuses a call whose run counted any (planning/meta/call_memo.py).
        self.impure_ops = 0
        # What mutating ops wrote into, in order (the call memo reads the tail of a run): the
        # identities of each tensor (:func:`_identities`), not the tensor, which may be freed.
        self.written: list[frozenset[Any]] = []
        self._attributes: dict[str, Any] | None = None  # a new FakeTensor's, once checked
        self._attributes = _checked_attributes(self, fake_mode)
        # A new FakeTensor's attributes but its device: what a fresh result carries.
        self.fake_attributes = (
            None if self._attributes is None else dict(self._attributes, _fake_device=None)
        )
        self.shared = shared  # the split's tables, the call memo's too (shared_memos)
        self.calls = CallMemo(self)

    def new_fake(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """``FakeTensor(self.fake_mode, elem, device)`` for a meta ``elem``, made quickly.

        Call it with dispatch disabled (as the memo's replays do): ``elem`` is the tensor's
        inside, and no mode must see it.
        """
        attributes = self._attributes
        if attributes is None or device.type != "meta":
            return FakeTensor(self.fake_mode, elem, device)
        made = torch.Tensor._make_subclass(
            FakeTensor, elem, elem.requires_grad, dispatch_device=True,
            device_for_backend_keys=device,
        )  # fmt: skip
        if self.fake_mode._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(made)
        else:
            torch._C._set_throw_on_mutable_data_ptr(made)
        made.__dict__.update(attributes)
        return made

    def fake_twin(self, tensor: torch.Tensor) -> FakeTensor:
        """The fake mode's fake tensor for the meta tensor ``tensor`` (see the glossary).

        The quick path makes what the converter's ordinary case makes (a fresh fake storage of
        the same size, the same metadata, ``requires_grad``, ``_is_param``) and records it in
        the converter's tensor and storage memos, so a later conversion of a tensor sharing
        that storage (or of ``tensor`` again) finds it, as it would have found the
        converter's own.
        """
        converter = self.fake_mode.fake_tensor_converter
        known = converter._get_memo(tensor)
        if known is not None:
            return known
        storage = tensor.untyped_storage()
        meta_converter = converter.meta_converter
        storage_id = meta_converter.describer.get_storage_id(storage)
        if (
            self._attributes is None
            or storage_id in meta_converter.storage_memo
            or tensor.storage_offset() != 0
            or not tensor.is_leaf
            or tensor.is_conj()
            or tensor.is_neg()
            or tensor.grad_dtype != tensor.dtype
        ):
            return converter.from_real_tensor(self.fake_mode, tensor)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            elem = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_META
            )
            if elem.untyped_storage().nbytes() != storage.nbytes():  # a view of a bigger one
                return converter.from_real_tensor(self.fake_mode, tensor)
            twin = self.new_fake(elem, _META)
            if tensor.requires_grad:
                twin.requires_grad_(True)
        if isinstance(tensor, torch.nn.Parameter):
            twin._is_param = True
        meta_converter.storage_memo[storage_id] = twin.untyped_storage()
        converter.set_tensor_memo(tensor, twin)
        return twin

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode otherwise wraps __torch_dispatch__ in torch._disable_dynamo, a
        # Python frame and four eval-frame switches on every op. The analysis never runs
        # under torch.compile, so there is nothing for it to disable.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:
            # What the fake mode answers (its ``_device_handler``), without its dispatch: C++
            # asks every fake tensor for its device several times per op.
            tensor = args[0] if len(args) == 1 and not kwargs else None
            if type(tensor) is FakeTensor:
                return _META if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
            return func(*args, **kwargs)
        if func in _VIEWS_IN_DISGUISE or _memoisable_view(func):
            return self._view(func, args, kwargs)
        if not _memoisable(func):
            if _impure(func):
                self.impure_ops += 1
                if reads_values(func):  # a failure says so by its type (meta_failures.py)
                    return run_value_reading_op(func, args, kwargs)
            elif func._schema.is_mutable:
                self._note_writes(func, args, kwargs)
            return func(*args, **kwargs)
        return self._lookup(
            func, args, kwargs, lambda out: self._entry(out, args, kwargs), self._replay
        )

    def _note_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Add the tensors a mutating op writes to :attr:`written` (the call memo checks that
        a run wrote none of its inputs, parameters or buffers)."""
        for position, name in _written_arguments(func):
            tensor = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(tensor, torch.Tensor):
                self.written.append(_identities(tensor))
            else:
                self.impure_ops += 1

    def _lookup(self, func: Any, args: tuple, kwargs: dict, record: Any, replay: Any) -> Any:
        """Answer ``func(*args, **kwargs)`` from the memo, or run it and ``record`` the result.

        ``record(out)`` returns the entry to keep (None: never memoise this signature);
        ``replay(entry)`` builds the answer of a repeated call.
        """
        try:
            key = (func, _key_of(args), _key_of(tuple(kwargs.items())) if kwargs else None)
        except TypeError:
            return func(*args, **kwargs)
        entry = self.results.get(key, _MISSING)
        if entry is _MISSING:
            self.misses += 1
            out = func(*args, **kwargs)
            self.results[key] = record(out)
            return out
        if entry is None:
            return func(*args, **kwargs)
        self.hits += 1
        return replay(entry)

    def _replay(self, entry: tuple) -> Any:
        single, outputs = entry
        # The fake mode below must not see these allocations: they are its tensors' insides.
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            made = [
                self.new_fake(torch.empty_strided(shape, stride, dtype=dtype, device=_META), device)
                for shape, stride, dtype, device in outputs
            ]
        return made[0] if single else tuple(made)

    def _view(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A view op: the answer is a new fake tensor on its first argument's storage."""
        base = args[0] if args else None
        if (
            isinstance(base, torch.Tensor)
            and not isinstance(base, FakeTensor)
            and base.device.type == "meta"
            and base.layout is torch.strided
            and type(base) in (torch.Tensor, torch.nn.Parameter)
        ):
            # A meta parameter (``weight.t()`` in every ``linear``): the fake mode would convert
            # it to its fake twin first (memoised per tensor by its converter); doing the same
            # here lets the memo answer the view on that twin.
            base = self.fake_twin(base)
            args = (base, *args[1:])
        if type(base) is not FakeTensor or base.fake_mode is not self.fake_mode:
            return func(*args, **kwargs)

        def replay(entry: tuple) -> FakeTensor:
            shape, stride, offset, dtype, device = entry
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                elem = torch.empty_strided(shape, stride, dtype=dtype, device=_META)
                elem.set_(base.untyped_storage(), offset, shape, stride)
                return self.new_fake(elem, device)

        return self._lookup(func, args, kwargs, lambda out: self._view_entry(out, base), replay)

    def _view_entry(self, out: Any, base: FakeTensor) -> tuple | None:
        if (
            type(out) is not FakeTensor
            or out.fake_mode is not self.fake_mode
            or out.constant is not None
            or out.requires_grad
            or out.is_conj()
            or out.is_neg()
        ):
            return None
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if out.untyped_storage()._cdata != base.untyped_storage()._cdata:
                return None
        return (out.shape, out.stride(), out.storage_offset(), out.dtype, out.device)

    def _entry(self, out: Any, args: tuple, kwargs: dict) -> tuple | None:
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else out
        if not isinstance(outputs, tuple):
            return None
        inputs = {
            id(value) for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)
        }
        metas = []
        for tensor in outputs:
            if (
                type(tensor) is not FakeTensor
                or tensor.fake_mode is not self.fake_mode
                or tensor.constant is not None
                or id(tensor) in inputs
                or tensor.layout is not torch.strided
                or tensor.requires_grad
                or tensor.storage_offset() != 0
                or tensor.is_conj()
                or tensor.is_neg()
            ):
                return None
            metas.append((tensor.shape, tensor.stride(), tensor.dtype, tensor.device))
        return single, tuple(metas)


_MISSING = object()


def _checked_attributes(memo: OpMemo, fake_mode: FakeTensorMode) -> dict[str, Any] | None:
    """A new FakeTensor's attribute dictionary, if quick construction reproduces the
    constructor's tensor on a probe; None (use the constructor) if anything differs."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        made = FakeTensor(fake_mode, torch.empty_strided((2, 3), (3, 1), device=_META), _META)
        attributes = dict(vars(made))
        memo._attributes = attributes
        quick = memo.new_fake(torch.empty_strided((2, 3), (3, 1), device=_META), _META)
        memo._attributes = None
        same = (
            type(quick) is type(made)
            and vars(quick) == attributes
            and torch._C._dispatch_keys(quick) == torch._C._dispatch_keys(made)
            and quick.device == made.device
            and quick.requires_grad == made.requires_grad
        )
    return attributes if same else None
