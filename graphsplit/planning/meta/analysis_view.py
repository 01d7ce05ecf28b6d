"""Run a model's code on the ``meta`` device: shapes, dtypes and FLOPs without real weights.

Glossary:
    analysis view: the model with every parameter and buffer temporarily replaced by a ``meta``
        tensor of the same shape, dtype and ``requires_grad`` (restored on exit). A 20B model
        costs no memory here, and models built on ``meta`` (``init_empty_weights``) work too.
    helper object: a non-module attribute of a module that holds state, such as a diffusers
        scheduler; code under analysis may rebind its tensors (``add_noise`` moves
        ``alphas_cumprod`` to the input's device), so its attributes are restored on exit.

    fake mode: the one ``FakeTensorMode(allow_non_fake_inputs=True)`` an analysis runs every op
        under (:func:`fake_mode`). Its values are ``FakeTensor``s backed by ``meta``: library
        code recognises them as a trace (transformers' ``masking_utils.is_tracing``, diffusers'
        ``is_torch_fx_proxy``-style checks) and takes its trace-safe path instead of reading
        tensor values; a factory with an explicit ``device=`` or ``generator=`` returns a fake
        tensor without allocating memory or drawing from any generator. Meta parameters are
        converted to fake ones on first use (memoised by the mode), so weights stay on ``meta``.

``meta_execution()`` is the context every analysis op runs in: the fake mode, no autograd,
factories default to ``meta``, stray real tensors (constants in helper objects) are moved
to ``meta``, and Python's own builtins are back if a trace replaced them
(:mod:`graphsplit.planning.patching.traced_builtins`: only traced values need the replacements).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from graphsplit.planning.meta import call_memo, shared_memos
from graphsplit.planning.meta.call_memo import CallMemo
from graphsplit.planning.meta.meta_failures import note_autocast
from graphsplit.planning.meta.module_moves import moves_stay_on_meta
from graphsplit.planning.meta.op_memo import OpMemo
from graphsplit.planning.patching.module_state import is_helper_object, restore_attributes
from graphsplit.planning.patching.originals import PLAIN_VALUE_TYPES
from graphsplit.planning.patching.patcher import patches_reverted

META = torch.device("meta")


def to_meta(value: Any) -> Any:
    """``value`` with every tensor in it moved to ``meta`` (no data is copied)."""

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "meta":
            return tensor
        return torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device=META
        ).requires_grad_(tensor.requires_grad and tensor.is_floating_point())

    return pytree.tree_map_only(torch.Tensor, convert, value)


class _StrayTensorsToMeta(TorchFunctionMode):
    """Moves real tensors that meet meta tensors in one op onto ``meta``; lets checks hold.

    ``torch._check_tensor_all_with(cond)`` (transformers' ``torch_compilable_check`` outside
    dynamo, e.g. LLaVA's "image tokens match image features") asserts a tensor condition by
    reading ``cond._is_all_true().item()``. An assertion states what must hold for the step to
    run at all, so the analysis assumes it holds, as torch.export does with ``torch._check``:
    a constant ``True`` answers it. The real check still runs on real data in either stage.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _IS_ALL_TRUE and _is_analysis_tensor(args[0]):
            return torch.tensor(True, device="cpu")  # a fake constant: .item() is True
        if _meta_meets_other_device((args, kwargs)):
            args, kwargs = to_meta((args, kwargs))
        try:  # free until raised (Python 3.11's zero-cost try)
            return func(*args, **kwargs)
        except Exception as exc:
            note_autocast(exc)  # a composite op's checks raise above the dispatch modes
            raise


_IS_ALL_TRUE = torch.Tensor._is_all_true


def _is_analysis_tensor(value: Any) -> bool:
    return isinstance(value, FakeTensor) or (
        isinstance(value, torch.Tensor) and value.device.type == "meta"
    )


def _meta_meets_other_device(tree: Any) -> bool:
    """Whether ``tree`` holds both a ``meta`` tensor and a tensor on another device.

    Runs on every torch call, so it is kept cheap. Only that mix needs :func:`to_meta`: with
    no meta tensor there is nothing to meet, and with meta tensors only (every fake tensor of
    the analysis reads ``meta``) the map would return its input unchanged.
    """
    return _devices_in(tree) == _BOTH


# What _devices_in finds, as bits: a meta tensor, a tensor on another device, or both.
_ON_META, _ELSEWHERE, _BOTH = 1, 2, 3


def _devices_in(tree: Any) -> int:
    """Which kinds of device the tensors in ``tree`` are on (bits: ``_ON_META | _ELSEWHERE``).

    Plain tuples, lists and dicts are walked directly, stopping once both kinds are seen;
    anything else goes through pytree, which knows the containers libraries register
    (transformers' ``ModelOutput``).
    """
    kind = type(tree)
    if kind is tuple or kind is list or kind is dict:
        found = 0
        for item in tree.values() if kind is dict else tree:
            found |= _devices_in(item)
            if found == _BOTH:
                break
        return found
    if isinstance(tree, torch.Tensor):
        return _ON_META if tree.device.type == "meta" else _ELSEWHERE
    if kind in PLAIN_VALUE_TYPES:
        return 0
    found = 0
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found |= _ON_META if leaf.device.type == "meta" else _ELSEWHERE
    return found


# The fake mode of the analysis in progress (innermost last) and its op memo; see fake_mode().
_FAKE_MODES: list[tuple[FakeTensorMode, OpMemo]] = []


def fake_mode() -> FakeTensorMode:
    """The fake mode of the analysis in progress, or a fresh one outside any analysis.

    One mode per :func:`analysis_view`: fake tensors of two modes cannot meet in one op, and
    the mode memoises the fake twin of every meta parameter it has converted.
    """
    return _fake_mode_and_memo()[0]


def _fake_mode_and_memo() -> tuple[FakeTensorMode, OpMemo]:
    if _FAKE_MODES:
        return _FAKE_MODES[-1]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode, OpMemo(mode)


def current_call_memo() -> CallMemo | None:
    """The call memo of the analysis in progress (:mod:`graphsplit.planning.meta.call_memo`),
    or None outside any analysis: a node's or module call's meta run is then run as it is."""
    return _FAKE_MODES[-1][1].calls if _FAKE_MODES else None


def module_called(module: nn.Module, call: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    """``call()``, which calls ``module(*args, **kwargs)`` on meta, or the analysis's memoised
    answer (:mod:`graphsplit.planning.meta.call_memo`); outside an analysis, ``call()``."""
    memo = current_call_memo()
    if memo is None:
        return call()
    return call_memo.replay_or_call_module(memo, module, call, args, kwargs)


@contextlib.contextmanager
def meta_execution() -> Iterator[None]:
    """Run code on fake ``meta`` tensors: no autograd, no real memory, no random draw.

    ``FakeTensorMode`` is what torch.export and dynamo trace under, so library code that asks
    "am I being traced?" says yes here and avoids reading tensor values.
    Repeated op signatures are answered by the analysis's :class:`OpMemo` (same results, a
    fraction of the fake mode's cost per op).
    """
    mode, memo = _fake_mode_and_memo()
    with patches_reverted(), torch.no_grad(), mode, META, _StrayTensorsToMeta(), memo:
        yield


@contextlib.contextmanager
def analysis_view(model: nn.Module) -> Iterator[None]:
    """Temporarily give ``model`` meta parameters and buffers; restore everything on exit.

    Parameters keep their ``requires_grad`` and tied parameters stay tied (one meta tensor per
    original object). Helper objects' attributes and attributes added to any module (torch.fx
    stores traced constants on the root) are restored too, and so are the modules' hook tables:
    code that installs hooks on first call and marks itself done (transformers'
    ``maybe_install_capturing_hooks``) must find both undone, or the next call would install
    its hooks a second time.
    """
    replaced: list[tuple[dict[str, Any], str, Any]] = []
    meta_of: dict[int, torch.Tensor] = {}
    modules = list(model.modules())
    module_dicts, helpers, hook_tables = _snapshot(modules)
    helper_dicts = [(obj, dict(vars(obj))) for obj in helpers]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _FAKE_MODES.append((mode, OpMemo(mode, shared_memos.current())))
    try:
        for module in modules:
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None or tensor.device.type == "meta":
                        continue
                    replaced.append((table, name, tensor))
                    table[name] = _meta_twin(tensor, meta_of)
        with moves_stay_on_meta():  # the step's own vae.to(device) keeps the view's weights
            yield
    finally:
        _FAKE_MODES.pop()
        for table, name, tensor in reversed(replaced):
            table[name] = tensor
        for module, saved in module_dicts:
            restore_attributes(module, saved)
        for obj, saved in helper_dicts:
            restore_attributes(obj, saved)
        for table, saved in hook_tables:
            if table or saved:
                table.clear()
                table.update(saved)


_Snapshot = tuple[
    list[tuple[nn.Module, dict[str, Any]]],
    list[Any],
    list[tuple[dict[Any, Any], dict[Any, Any]]],
]


def _snapshot(modules: list[nn.Module]) -> _Snapshot:
    """One pass over the modules' attributes: ``(module, copy of its __dict__)`` per module,
    the helper objects (schedulers, configs) they hold, and ``(table, copy)`` for every hook
    dict (``_forward_hooks`` and kin).

    Hook tables are restored in place: a hook's ``RemovableHandle`` refers to the table object
    itself. The modules are listed once by the caller: ``model.modules()`` is a recursive
    generator whose cost grows with the depth of the tree.
    """
    module_dicts = []
    helpers: dict[int, Any] = {}
    hook_tables = []
    for module in modules:
        attributes = dict(vars(module))
        module_dicts.append((module, attributes))
        for name, value in attributes.items():
            kind = type(value)
            if kind in _PLAIN_ATTRIBUTES:  # most attributes: decided by the exact type
                continue
            if kind is dict or kind is OrderedDict:  # a module's tables; no helper object
                if "hooks" in name:
                    hook_tables.append((value, dict(value) if value else _NO_HOOKS))
            elif is_helper_object(value):
                helpers.setdefault(id(value), value)
            elif "hooks" in name and isinstance(value, dict):
                hook_tables.append((value, dict(value) if value else _NO_HOOKS))
    return module_dicts, list(helpers.values()), hook_tables


# Exact types of attribute values that are neither helper objects nor hook tables (the
# first test of state.is_helper_object, without its call per attribute).
_PLAIN_ATTRIBUTES = frozenset(
    {int, float, bool, str, bytes, type(None), list, tuple, set, frozenset, torch.Tensor}
)
# The saved copy of every hook table that was empty (most of them): one shared, never written.
_NO_HOOKS: dict[Any, Any] = {}


def _meta_twin(tensor: torch.Tensor, meta_of: dict[int, torch.Tensor]) -> torch.Tensor:
    twin = meta_of.get(id(tensor))
    if twin is None:
        empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=META)
        if isinstance(tensor, nn.Parameter):
            twin = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        else:
            twin = empty
        meta_of[id(tensor)] = twin
    return twin
