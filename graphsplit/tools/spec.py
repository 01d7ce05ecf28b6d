"""What the ``graphsplit`` command line needs from a user's step: :class:`StepSpec`, and its loader.

Glossary:
    step spec (:class:`StepSpec`, public as ``graphsplit.StepSpec``): the training step module,
        an example batch, the frozen parameters, and the data to cache: a ``dataset`` (batched
        by the command line, optionally with the spec's ``collate_fn`` and ``num_workers``) or
        a ready ``loader``; and the ``storage_dtype`` the cache stores floats in.
    spec text: how the command line names the function that returns a step spec:
        ``path/to/file.py:function`` (a file, imported under a private module name) or
        ``package.module:function`` (imported from ``PYTHONPATH``).

The function takes no arguments and returns a :class:`StepSpec`::

    # my_step.py
    import graphsplit

    def step():
        model = build_my_training_step()          # forward(batch...) -> loss
        pixels, ids = torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2, 77))
        return graphsplit.StepSpec(model, example_args=(pixels, ids), dataset=my_dataset)

    $ graphsplit inspect my_step.py:step --out plan/

In and out::

    load_spec(text: str) -> StepSpec           raises SpecError, whose message says the fix
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphsplit.errors import Fix, GraphsplitError, user_error
from graphsplit.planning.step.frozen import FrozenSpec

__all__ = ["SpecError", "StepSpec", "load_spec"]


class SpecError(GraphsplitError):
    """A ``file.py:function`` / ``module:function`` spec cannot be loaded."""


@dataclass
class StepSpec:
    """A training step for the command line: the model, an example batch, and the dataset.

    Args:
        model: the module whose ``forward`` runs the whole step and returns the loss.
        example_args, example_kwargs: an example batch, as for :func:`graphsplit.split`.
        frozen: which parameters are frozen (see :func:`graphsplit.split`); ``None`` uses
            ``requires_grad``.
        dataset: the dataset ``graphsplit cache`` runs stage 1 over (items are dicts of the
            forward's inputs, optionally with a ``"key"``); not needed by ``inspect``.
        loader: instead of ``dataset``, the user's own data pipeline: a ``DataLoader`` (not
            shuffled, not ``accelerator.prepare``'d) or any iterable of batches. The command
            line then takes its batching as it is (``--batch-size`` / ``--num-workers`` do not
            apply).
        collate_fn, num_workers: how the command line batches ``dataset`` (the
            ``DataLoader`` arguments); ``--num-workers`` overrides ``num_workers``.
        storage_dtype: ``None`` caches losslessly; ``torch.bfloat16`` / ``torch.float16``
            store wider floats narrower (see :func:`graphsplit.cache`); ``--storage-dtype``
            overrides it.

    Example:
        >>> import torch
        >>> spec = StepSpec(torch.nn.Linear(2, 1), example_args=(torch.randn(3, 2),))
        >>> spec.example_kwargs
        {}
    """

    model: nn.Module
    example_args: tuple[Any, ...] = ()
    example_kwargs: dict[str, Any] | None = None
    frozen: FrozenSpec = None
    dataset: Any = None
    loader: Any = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    num_workers: int | None = None
    storage_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.example_args, tuple):
            self.example_args = (self.example_args,)
        self.example_kwargs = dict(self.example_kwargs or {})


def load_spec(text: str) -> StepSpec:
    """Import ``path/to/file.py:function`` or ``module:function``, call it, check the result.

    Raises:
        SpecError: bad format, missing file, import error, missing function, or a function
            that does not return a :class:`StepSpec`.
    """
    location, function_name = _parse(text)
    module = _import(location)
    function = getattr(module, function_name, None)
    if function is None or not callable(function):
        raise user_error(
            SpecError,
            f"{location} has no function {function_name!r}.",
            fix=Fix(f"define `def {function_name}(): return graphsplit.StepSpec(...)` there"),
        )
    try:
        result = function()
    except Exception as error:
        raise user_error(
            SpecError,
            f"calling {text} failed: {type(error).__name__}: {error}.",
            fix=Fix("call the function in Python to see the full traceback"),
        ) from None
    if not _looks_like_spec(result):
        raise user_error(
            SpecError,
            f"{text} returned a {type(result).__name__}, not a graphsplit.StepSpec.",
            fix=Fix("return StepSpec(model, example_args=(...), dataset=...)"),
        )
    if not isinstance(result, StepSpec):
        result = StepSpec(
            result.model,
            tuple(getattr(result, "example_args", ()) or ()),
            getattr(result, "example_kwargs", None),
            getattr(result, "frozen", None),
            getattr(result, "dataset", None),
            getattr(result, "loader", None),
            getattr(result, "collate_fn", None),
            getattr(result, "num_workers", None),
            getattr(result, "storage_dtype", None),
        )
    if not isinstance(result.model, nn.Module):
        raise user_error(
            SpecError,
            f"{text} returned a StepSpec whose model is a {type(result.model).__name__}, "
            "not a torch.nn.Module.",
            fix=Fix("pass the module that runs the training step"),
        )
    _check_data(text, result)
    return result


STORAGE_DTYPES = (torch.bfloat16, torch.float16)


def _check_data(text: str, spec: StepSpec) -> None:
    """Refuse data options that contradict each other, naming the field to drop."""
    if spec.loader is not None:
        given = [name for name in ("dataset", "collate_fn", "num_workers") if getattr(spec, name)]
        if given:
            raise user_error(
                SpecError,
                f"{text} returned a StepSpec with a loader and {', '.join(given)}: the loader "
                "already decides how the data is read and batched.",
                fix=Fix(f"drop {', '.join(given)}, or drop loader and give dataset=..."),
            )
    if spec.num_workers is not None and (
        not isinstance(spec.num_workers, int) or spec.num_workers < 0
    ):
        raise user_error(
            SpecError,
            f"{text} returned a StepSpec with num_workers={spec.num_workers!r}.",
            fix=Fix("pass a whole number >= 0 (0 loads in the main process)"),
        )
    if spec.storage_dtype is not None and spec.storage_dtype not in STORAGE_DTYPES:
        raise user_error(
            SpecError,
            f"{text} returned a StepSpec with storage_dtype={spec.storage_dtype!r}.",
            fix=Fix("pass None (lossless), torch.bfloat16 or torch.float16"),
        )


def _looks_like_spec(value: Any) -> bool:
    return isinstance(value, StepSpec) or (
        hasattr(value, "model") and hasattr(value, "example_args")
    )


def _parse(text: str) -> tuple[str, str]:
    location, separator, function_name = text.rpartition(":")
    if not separator or not location or not function_name.isidentifier():
        raise user_error(
            SpecError,
            f"{text!r} is not a step spec.",
            fix=Fix("write path/to/file.py:function or package.module:function"),
        )
    return location, function_name


def _import(location: str) -> Any:
    is_file = location.endswith(".py") or "/" in location or "\\" in location
    if not is_file:
        try:
            return importlib.import_module(location)
        except ImportError as error:
            raise user_error(
                SpecError,
                f"cannot import module {location!r}: {error}.",
                fix=Fix("check the module name and that it is on PYTHONPATH, or pass a file path"),
            ) from None
        except Exception as error:
            raise _import_failed(location, error) from None
    path = Path(location)
    if not path.is_file():
        raise user_error(
            SpecError,
            f"no such file: {location}.",
            fix=Fix("check the path to the spec file"),
        )
    name = f"_graphsplit_spec_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise user_error(
            SpecError,
            f"cannot load {location} as Python.",
            fix=Fix("pass a .py file"),
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(name, None)
        raise _import_failed(location, error) from None
    return module


def _import_failed(location: str, error: Exception) -> GraphsplitError:
    return user_error(
        SpecError,
        f"importing {location} failed: {type(error).__name__}: {error}.",
        fix=Fix("run the file with python to see the full traceback"),
    )
