"""What a failing op of a meta run becomes: a value read, told by its type, or a TraceError.

Glossary:
    value read: an op that needs a tensor's value, which a meta run does not have. Either its
        result is a value (``aten._local_scalar_dense`` behind ``.item()``, ``.tolist()``,
        ``bool()``, ``int()``; ``equal``, ``allclose``) or its output's shape depends on
        values (``nonzero``, ``masked_select``, boolean-mask indexing, ``unique``,
        ``repeat_interleave`` by a tensor). torch tags such ops ``data_dependent_output`` or
        ``dynamic_output_shape`` (:func:`reads_values`).
    where a value read is told: at the op, by type. On the analysis's fake tensors torch's fake
        mode raises a typed exception there (:data:`VALUE_READ_FAILURES`), also for an op that
        reads values inside its own decomposition (boolean-mask indexing runs ``nonzero``). On
        a plain ``meta`` tensor, with the fake mode set aside (``unset_fake_temporarily``),
        the op's meta kernel raises a plain ``RuntimeError`` instead; the op memo, which every
        op of a meta run passes on its way to the fake mode, runs each value-reading op through
        :func:`run_value_reading_op`, which raises the fake mode's typed exception for it.
        No decision reads an error's message: a failure whose text says ``item()`` is no value
        read unless its type says so.

In: the op memo's value-reading ops; the exception of every node whose meta run failed.

    reads_values(func) -> bool
    run_value_reading_op(func, args, kwargs) -> Any   # a failure: one of VALUE_READ_FAILURES
    meta_failure(node, exc) -> TraceError   # a TensorValueError for a value read, naming its line
    note_autocast(exc)                      # as an op fails (analysis_view): the autocasts on
    ArgumentWritten                         # a module wrote into a dict / list argument
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from graphsplit.errors import Fix, TensorValueError, TraceError, user_error
from graphsplit.planning.rules.grad_modes import current_modes
from graphsplit.planning.rules.user_lines import describe, frame_location_of, is_internal

AUTOCAST_INSIDE_FIX = Fix(
    'split with path="auto" (the default) or path="calls": the module-level path runs the '
    "step's own code under its autocast; or split before accelerator.prepare wraps the "
    "model's forward in its autocast, with the autocast around graphsplit.split, "
    "graphsplit.cache and training"
)

# What torch raises at an op that needs a tensor's value: the fake mode for an op whose result
# is a value, or whose output shape depends on values; a shape environment (none in the
# analysis's fake mode, listed for a library that brings its own) for a branch on a value.
VALUE_READ_FAILURES: tuple[type[Exception], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)


class TensorMethodValueRead(DataDependentOutputException):
    """A tensor method that reads values in Python, not through an ATen op (``tolist()``,
    ``numpy()``), called on a meta tensor: raised by the eager protocols on meta
    (:mod:`~graphsplit.planning.meta.eager_protocols`), where the method itself would fail with
    a plain ``RuntimeError`` about storage. Typed as the op it stands for, so it is a value
    read like ``.item()``. ``line`` is where it was called (``file:line  code``), often inside
    a library's model, below the step's line the error names."""

    def __init__(self, method: str, line: str) -> None:
        super().__init__(torch.ops.aten._local_scalar_dense.default)
        self.method, self.line = method, line

    def __str__(self) -> str:
        return f"Tensor.{self.method}() reads the tensor's values, at {self.line}"


def reads_values(func: Any) -> bool:
    """Whether the ATen op ``func`` needs its inputs' values (by its tags, once per op)."""
    known = _READS_VALUES.get(func)
    if known is None:
        tags = getattr(func, "tags", ())
        known = _READS_VALUES[func] = (
            torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags
        )
    return known


_READS_VALUES: dict[Any, bool] = {}


def run_value_reading_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for an op that :func:`reads_values`; failing, it raises what
    the fake mode raises for it, also where the fake mode was set aside and the op's meta
    kernel refused a plain meta tensor with a ``RuntimeError`` of its own."""
    try:
        return func(*args, **kwargs)
    except VALUE_READ_FAILURES:
        raise
    except RuntimeError as exc:
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            raise  # the fake mode ran it: any value read would have been typed
        if torch.Tag.data_dependent_output in func.tags:
            raise DataDependentOutputException(func) from exc
        raise DynamicOutputShapeException(func) from exc


class ArgumentWritten(Exception):
    """A module called as one node of the graph wrote into a dict or list it was given
    (sentence-transformers' modules add ``features["token_embeddings"]`` to the dict they
    get): the step's own code may read that write afterwards, which the graph cannot show."""

    def __init__(self, module: str, kind: str) -> None:
        super().__init__(f"{module} writes into the {kind} it is given")
        self.module = module
        self.kind = kind


# Constructors that copy a Python sequence's items into a new tensor. Given tensors among the
# items (``torch.Tensor([a.mean(), a.max()])``), they read each one's value in C++, past the
# ATen ops the meta run types its failures at: on meta, a plain ``RuntimeError`` (``item()``)
# or ``TypeError``. Told by the node (its target, tensors among its data), not the message.
_FROM_ITEMS: frozenset[Any] = frozenset(
    {
        torch.tensor,
        torch.as_tensor,
        torch.Tensor,
        torch.FloatTensor,
        torch.DoubleTensor,
        torch.HalfTensor,
        torch.BFloat16Tensor,
        torch.LongTensor,
        torch.IntTensor,
        torch.ShortTensor,
        torch.CharTensor,
        torch.ByteTensor,
        torch.BoolTensor,
    }
)


def copies_tensor_items(node: fx.Node) -> bool:
    """Whether ``node`` builds a tensor from a sequence holding graph values (tensors): a
    value read of each of them, as ``.item()`` is."""
    if node.op != "call_function" or node.target not in _FROM_ITEMS or not node.args:
        return False
    data = node.args[0]
    if not isinstance(data, (list, tuple)):
        return False
    found: list[fx.Node] = []
    fx.node.map_arg(data, found.append)
    return bool(found)


def note_autocast(exc: Exception) -> None:
    """Record on ``exc`` the autocasts that were on when an op of a meta run failed.

    ``torch.autocast`` casts only tensors of its own device type, never the analysis's meta
    stand-ins. Code that enters an autocast itself (accelerate's ``prepare`` wraps a model's
    ``forward`` in one) feeds a bfloat16 tensor to a float32 layer, which the real run casts
    first and a meta kernel refuses ("Input type (c10::BFloat16) and bias type (float)").
    Told by :func:`meta_failure` once the node's run has ended, when the autocast is off again.
    """
    if not hasattr(exc, "graphsplit_autocast"):
        with contextlib.suppress(AttributeError):  # an exception type without a __dict__
            exc.graphsplit_autocast = current_modes().autocast  # type: ignore[attr-defined]


def meta_failure(node: fx.Node, exc: Exception) -> TraceError:
    """The error for ``node``, whose meta run raised ``exc``: a :class:`TensorValueError` when
    ``exc`` is a value read (:data:`VALUE_READ_FAILURES`, or a tensor built from tensor items:
    :func:`copies_tensor_items`; the planning may retry the code around it as one opaque
    step), else a :class:`TraceError` with the usual cause spelled out.
    """
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if copies_tensor_items(node):
        name = getattr(node.target, "__module__", "torch") + "." + node.target.__name__
        error = user_error(
            TensorValueError,
            f"The step builds a tensor with {name}(...) from a list holding tensors, which "
            "reads each tensor's value; graphsplit decides the split without real data, so "
            "values cannot steer the step.",
            node=node,
            fix=Fix(
                "build it with torch.stack([...]) (0-dim items) or torch.cat([...]), which keep "
                "the values in tensors, or compute it in the data pipeline"
            ),
        )
        error.read_at = _user_line_of(node)
        return error
    if isinstance(exc, VALUE_READ_FAILURES):
        inner = "" if isinstance(exc, TensorMethodValueRead) else _innermost_user_line(exc)
        error = user_error(
            TensorValueError,
            f"The step reads the value of a tensor ({message}){inner}; graphsplit decides the "
            "split without real data, so values cannot steer the step.",
            node=node,
            fix=Fix(
                "replace .item()/.tolist()/nonzero-style code with tensor ops (torch.where, "
                "masking), or move it into the data pipeline"
            ),
        )
        error.read_at = _user_line_of(node)
        return error
    if isinstance(exc, ArgumentWritten):
        return user_error(
            TraceError,
            f"The module {exc.module} writes into the {exc.kind} it is given. The whole-step "
            f"trace passes a module call's arguments as values of the graph, so the step's own "
            f"code would not see that write if it read the {exc.kind} afterwards.",
            node=node,
            fix=Fix(
                'split with path="auto" (the default) or path="calls": the module-level path '
                "runs the step's own code, and caches the module's output"
            ),
        )
    autocast = getattr(exc, "graphsplit_autocast", ())
    if autocast:
        modes = ", ".join(
            f"{device}: {str(dtype).removeprefix('torch.')}" for device, dtype in autocast
        )
        return user_error(
            TraceError,
            f"Running this operation on meta tensors failed under an autocast ({modes}) the "
            f"step's code entered: {type(exc).__name__}: {message}. graphsplit's analysis runs "
            "ops on meta tensors, which autocast does not cast, so dtypes meet here that the "
            "real run casts first.",
            node=node,
            fix=AUTOCAST_INSIDE_FIX,
        )
    return user_error(
        TraceError,
        f"Running this operation on meta tensors failed: {type(exc).__name__}: {message}",
        node=node,
        fix=Fix(
            "make the step device-agnostic (take devices from input tensors, avoid .cpu()/"
            ".numpy()); if the failure is inside a library module, report it with this message"
        ),
    )


def _user_line_of(node: fx.Node) -> str | None:
    """``file:line  code`` of the user's line that made ``node`` (its source alone without the
    code), which a value read's retry keys on."""
    source, code = node.meta.get("source"), node.meta.get("source_code")
    return f"{source}  {code}" if source and code else source


def _innermost_user_line(exc: Exception) -> str:
    """`` at file:line  code`` of the innermost frame of ``exc``'s traceback outside torch and
    graphsplit: where a library called as one node (a whole peft model) read the value (its
    ``if torch.rand(1) > module_dropout:``), below the step's line the node names; ``""`` when
    the traceback has no such frame."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        if not is_internal(tb.tb_frame.f_code.co_filename):
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return "" if found is None else f" at {describe(frame_location_of(*found))}"
