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
factories default to ``meta``, and stray real tensors (constants in helper objects) are moved
to ``meta``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from graphsplit.planning.memo import OpMemo

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
        if _has_meta_tensor((args, kwargs)):
            args, kwargs = to_meta((args, kwargs))
        return func(*args, **kwargs)


_IS_ALL_TRUE = torch.Tensor._is_all_true


def _is_analysis_tensor(value: Any) -> bool:
    return isinstance(value, FakeTensor) or (
        isinstance(value, torch.Tensor) and value.device.type == "meta"
    )


def _has_meta_tensor(tree: Any) -> bool:
    """Whether a meta tensor is anywhere in ``tree`` (runs on every torch call: kept cheap).

    Plain tuples, lists and dicts are walked directly; anything else goes through pytree,
    which knows the containers libraries register (transformers' ``ModelOutput``).
    """
    kind = type(tree)
    if kind is tuple or kind is list:
        return any(_has_meta_tensor(item) for item in tree)
    if kind is dict:
        return any(_has_meta_tensor(item) for item in tree.values())
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "meta"
    if kind in _ATOMS:
        return False
    return any(
        isinstance(leaf, torch.Tensor) and leaf.device.type == "meta"
        for leaf in pytree.tree_leaves(tree)
    )


_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size})


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


@contextlib.contextmanager
def meta_execution() -> Iterator[None]:
    """Run code on fake ``meta`` tensors: no autograd, no real memory, no random draw.

    ``FakeTensorMode`` is what torch.export and dynamo trace under, so library code that asks
    "am I being traced?" says yes here and avoids reading tensor values.
    Repeated op signatures are answered by the analysis's :class:`OpMemo` (same results, a
    fraction of the fake mode's cost per op).
    """
    mode, memo = _fake_mode_and_memo()
    with torch.no_grad(), mode, META, _StrayTensorsToMeta(), memo:
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
    module_dicts = {id(module): dict(vars(module)) for module in model.modules()}
    helpers = _helper_objects(model)
    helper_dicts = {id(obj): dict(vars(obj)) for obj in helpers}
    hook_tables = _hook_tables(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _FAKE_MODES.append((mode, OpMemo(mode)))
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None or tensor.device.type == "meta":
                        continue
                    replaced.append((table, name, tensor))
                    table[name] = _meta_twin(tensor, meta_of)
        yield
    finally:
        _FAKE_MODES.pop()
        for table, name, tensor in reversed(replaced):
            table[name] = tensor
        for module in model.modules():
            _restore_dict(module, module_dicts.get(id(module)))
        for obj in helpers:
            _restore_dict(obj, helper_dicts[id(obj)])
        for table, saved in hook_tables:
            table.clear()
            table.update(saved)


def _hook_tables(model: nn.Module) -> list[tuple[dict[Any, Any], dict[Any, Any]]]:
    """``(table, copy)`` for every hook dict of every module (``_forward_hooks`` and kin).

    Restored in place: a hook's ``RemovableHandle`` refers to the table object itself.
    """
    return [
        (table, dict(table))
        for module in model.modules()
        for name, table in vars(module).items()
        if "hooks" in name and isinstance(table, dict)
    ]


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


def _helper_objects(model: nn.Module) -> list[Any]:
    """Plain Python objects (schedulers, configs) stored as attributes of the model's modules."""
    found: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if _is_helper_object(value):
                found.setdefault(id(value), value)
    return list(found.values())


def _is_helper_object(value: Any) -> bool:
    if isinstance(value, (nn.Module, torch.Tensor, type)) or callable(value):
        return False
    return hasattr(value, "__dict__") and not isinstance(value, (dict, list, tuple))


def _restore_dict(obj: Any, saved: dict[str, Any] | None) -> None:
    if saved is None:
        return
    current = vars(obj)
    for key in [key for key in current if key not in saved]:
        del current[key]
    for key, value in saved.items():
        if current.get(key, _MISSING) is not value:
            current[key] = value


_MISSING = object()
