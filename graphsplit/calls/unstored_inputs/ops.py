"""What an operation on a stand-in for an unstored input may do (:mod:`.stand_in`), and how
the probe classes the same operation on the real input (:mod:`.derivation`).

An operation on a tensor computed from the input runs, in stage 2, on ``meta`` (:func:`on_meta`)
and gives a stand-in: that is exact as long as nothing of the input's values leaves the
stand-ins. :func:`refusal` names the operations through which they would (or which cannot run
on ``meta``): a read giving a Python value (``.item()``, ``bool()``, ``==`` of two tensors), a
write into a tensor in place (the real one would change, the stand-in does not), a random draw
(on ``meta`` it draws nothing, so the generator would move differently) and autograd run
through it.

``.device`` is no value but where the batch is (DETR's ``device = pixel_values.device`` builds
its pixel mask and position embeddings there), and a stand-in lives on ``meta``: stage 2
answers it with the device the batch's other tensors are on, the training device the user moved
the cached batch to, as the unsplit step's batch was moved. :func:`result_device` carries that
device through the calls on a stand-in (the probe carries the real one the same way): a call
gives the device its tensor arguments share, a move the device it names (``.to(x.device)``,
``.cpu()``); where neither is certain (a ``.to("cuda")`` without an index, ``.type()``,
arguments on several devices) the device is unknown, and a read of it refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphsplit.calls.field_reads import FREE, SHAPE, read_kind

TENSOR_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
"""Properties that give a tensor of the same values (a view or an alias): they stay stand-ins."""

RANDOM = frozenset(
    {
        "bernoulli",
        "bernoulli_",
        "multinomial",
        "normal",
        "normal_",
        "poisson",
        "rand_like",
        "randn_like",
        "randint_like",
        "uniform_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
        "dropout",
        "dropout_",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "native_dropout",
        "rrelu",
        "rrelu_",
        "gumbel_softmax",
    }
)
"""Torch functions that draw random numbers (dropout whether or not it is training: the name
decides, in the probe and in stage 2 alike)."""

PYTHON_VALUED = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__complex__",
        "__index__",
        "__array__",
        "__format__",
        "__repr__",
        "__reduce_ex__",
        "__deepcopy__",
        "data_ptr",
        "equal",
        "allclose",
        "is_nonzero",
        "__contains__",
        "backward",
        "register_hook",
    }
)
"""Calls that hand Python the values (or run autograd through them): never on a stand-in."""

_MOVES = frozenset({"cuda", "cpu", "pin_memory", "xpu", "mps"})


def refusal(func: Callable[..., Any], kwargs: dict[str, Any] | None) -> str | None:
    """Why ``func`` cannot run on a stand-in (a phrase: "writes into a tensor in place"), or
    None when it can run on ``meta`` and give stand-ins."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        prop = getattr(getattr(func, "__self__", None), "__name__", "?")
        if read_kind(func) in (FREE, SHAPE) or prop in TENSOR_PROPERTIES:
            return None
        return f"reads its .{prop}"
    if name in RANDOM or (kwargs and kwargs.get("generator") is not None):
        return f"draws random numbers ({name})"
    if name in PYTHON_VALUED:
        return f"hands its values to Python ({name})"
    if writes_in_place(name, kwargs):
        return f"writes into a tensor in place ({name})"
    return None


def reads_device(func: Callable[..., Any]) -> bool:
    """``tensor.device`` (its descriptor's ``__get__``)."""
    return getattr(func, "__name__", "") == "__get__" and (
        getattr(getattr(func, "__self__", None), "__name__", "") == "device"
    )


def result_device(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    device_of: Callable[[torch.Tensor], torch.device | None],
) -> torch.device | None:
    """The device ``func``'s tensors come out on, where its tensor arguments are on the
    devices ``device_of`` gives (None: unknown): the device a move names exactly, else the one
    device its tensor arguments share."""
    name = getattr(func, "__name__", "")
    target = (kwargs or {}).get("device")
    if target is None and name == "to" and len(args) > 1:
        named = args[1]  # x.to(device, ...) or x.to(other, ...); not x.to(dtype)
        if isinstance(named, str | torch.device | torch.Tensor) or (
            isinstance(named, int) and not isinstance(named, bool)
        ):
            target = named
    if isinstance(target, torch.Tensor):
        return device_of(target)
    if target is not None:
        return _exact_device(target)
    if name == "cpu":
        return torch.device("cpu")
    if name in _MOVES or name == "type":  # .cuda(), .type("torch.cuda..."): somewhere unnamed
        return None
    devices = {
        device_of(leaf)
        for leaf in pytree.tree_leaves((args, kwargs or {}))
        if isinstance(leaf, torch.Tensor)
    }
    return devices.pop() if len(devices) == 1 else None


def _exact_device(target: Any) -> torch.device | None:
    """``target`` as the device a tensor moved there reports, where that is certain: a device
    named without its index (``"cuda"``) reports the current one (``cuda:0``), so is unknown."""
    try:
        device = torch.device(target)
    except (RuntimeError, TypeError, ValueError):
        return None
    return device if device.index is not None or device.type in ("cpu", "meta") else None


def writes_in_place(name: str, kwargs: dict[str, Any] | None) -> bool:
    """``x.add_(y)``, ``x[i] = y``, ``x += y``, ``torch.add(x, y, out=z)``."""
    if kwargs and kwargs.get("out") is not None:
        return True
    if name in ("__setitem__", "__set__"):
        return True
    if name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__"):
        return name[3:-2] in _AUGMENTED
    return name.endswith("_") and not name.startswith("_")


_AUGMENTED = frozenset(
    [
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
        "matmul",
    ]
)


def python_valued(func: Callable[..., Any], result: Any) -> bool:
    """Whether ``result`` hands Python something of the values: a non-tensor from a read that
    is not of the dtype, rank or shape (``.tolist()`` of a name not listed above)."""
    if read_kind(func) in (FREE, SHAPE):
        return False
    return any(
        leaf is not None and not isinstance(leaf, torch.Tensor)
        for leaf in pytree.tree_leaves(result)
    )


def on_meta(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` run on ``meta``: every tensor argument replaced by an empty one of its shape,
    strides and dtype there, every device asked for by ``meta``."""

    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                return value
            return torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device="meta"
            )
        if isinstance(value, torch.device):
            return torch.device("meta")
        return value

    name = getattr(func, "__name__", "")
    # A stand-in's own metadata is read here without its __torch_function__ (which refuses
    # .device): the subclass is disabled for the whole call.
    with torch._C.DisableTorchFunctionSubclass():
        args, kwargs = pytree.tree_map(meta, (args, dict(kwargs or {})))
        if name in _MOVES:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = "meta"
        if name == "to":
            args = tuple(
                "meta" if index and isinstance(arg, str) and _is_device(arg) else arg
                for index, arg in enumerate(args)
            )
        return func(*args, **kwargs)


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True
