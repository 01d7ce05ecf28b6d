"""Bind the example batch to ``forward``'s parameters and make its meta twins at two sizes.

Glossary:
    example batch: the ``args``/``kwargs`` given to :func:`graphsplit.split`. Only shapes,
        dtypes and devices are read, never values.
    batched input: a tensor whose first dim equals the first tensor's; other inputs are
        per-dataset constants.
    probe sizes: two batch sizes, both at least 2, at which the step is analysed. At size 1
        kernels pick other ops (a reshape of a transposed tensor is a view at batch 1 and a copy
        at batch 3), which would look like batch mixing.
    home device: where the step really runs: the inputs' device, else the first real
        parameter's (code that read ``.device`` while tracing saw ``meta``).
    one sample per batch: a step whose code only runs at batch size 1 (DiffSynth-Studio's
        ``rearrange(..., B=1)``, noise of shape ``(1, ...)``; it trains with
        ``collate_fn=lambda x: x[0]``). Given a batch-1 example it is analysed at batch 1 only
        (probe sizes :data:`ONE_SAMPLE`): each batch is one sample, so every tensor computed
        from the data is that sample's and no batch dim has to be inferred. Its stage 1 checks
        at run time that a batch holds one sample (:func:`check_one_sample`).

In: the model and the example batch. Out: :class:`~graphsplit.artifacts.ExampleInputs`:

    bind_examples(model, args, kwargs) -> ExampleInputs
    one_sample_examples(examples) -> ExampleInputs      # the same batch, analysed at batch 1
    check_one_sample(value, name) -> value               # stage 1's run-time check
    defaults_not_given(model, values) -> {name: default} | None   # the trace's concrete_args
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from graphsplit.artifacts import ExampleInputs
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.meta.analysis_view import META, to_meta

ONE_SAMPLE = (1, 1)
"""The probe sizes of a step analysed one sample per batch."""


def bind_examples(model: nn.Module, args: Any, kwargs: dict[str, Any]) -> ExampleInputs:
    """The example batch by parameter name, its probe sizes, meta twins and home device."""
    inputs = _bind_inputs(model, args, kwargs)
    example_batch = _example_batch_size(inputs)
    _refuse_tensor_lists(inputs, example_batch)
    batch_sizes = (max(example_batch, 2), max(example_batch, 2) + 2)
    values = (
        _example_values(inputs, example_batch, batch_sizes[0]),
        _example_values(inputs, example_batch, batch_sizes[1]),
    )
    return ExampleInputs(inputs, batch_sizes, values, _home_device(model, inputs))


def one_sample_examples(examples: ExampleInputs) -> ExampleInputs:
    """The same batch-1 example, analysed at batch 1 only: one sample per batch.

    Both probe runs see the example's own shapes; the analysis then takes every tensor computed
    from the data as the one sample's (see ``rounds``), instead of comparing two batch sizes.
    """
    if example_batch_size(examples) != 1:
        raise user_error(
            SplitError,
            "One sample per batch needs a batch-1 example; this one has "
            f"{example_batch_size(examples)} rows.",
            fix=Fix("pass an example batch of one sample"),
        )
    values = {name: to_meta(value) for name, value in examples.inputs.items()}
    return ExampleInputs(examples.inputs, ONE_SAMPLE, (values, values), examples.device)


def example_batch_size(examples: ExampleInputs) -> int:
    """The batch size of the example the user passed (not of the probes)."""
    return _example_batch_size(examples.inputs)


def check_one_sample(value: torch.Tensor, name: str) -> torch.Tensor:
    """``value``, after checking it holds one sample: stage 1 of a one-sample-per-batch plan.

    Such a step was analysed at batch 1 because its code runs at no other size; a bigger batch
    would fail deep inside the user's code, or silently compute something else.
    """
    if value.dim() > 0 and value.shape[0] != 1:
        raise user_error(
            SplitError,
            f"The input {name!r} holds {value.shape[0]} samples (shape {tuple(value.shape)}), "
            "but this plan runs one sample per batch: the step only ran at batch size 1 when "
            "it was split.",
            fix=Fix(
                "feed one sample per batch (DataLoader(batch_size=1), or DiffSynth's "
                "collate_fn=lambda x: x[0] with a batch dim of 1), or make the step run at "
                "batch 2 and split it again"
            ),
        )
    return value


def _bind_inputs(model: nn.Module, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(args, tuple):
        args = (args,)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise user_error(
            SplitError,
            f"The example batch does not match {type(model).__name__}.forward: {exc}.",
            fix=Fix("pass args/kwargs exactly as you would call the model"),
        ) from None
    for name, parameter in inspect.signature(model.forward).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise user_error(
                SplitError,
                f"{type(model).__name__}.forward takes *{name}; graphsplit needs named inputs.",
                fix=Fix("give forward explicit parameters (one per batch field)"),
            )
    return dict(bound.arguments)


def _example_batch_size(inputs: dict[str, Any]) -> int:
    for _, value in [*inputs.items(), *_named_fields(inputs)]:  # top level first, then dicts'
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    nested = [
        name
        for name, value in inputs.items()
        if type(value) in (list, tuple)
        and any(
            isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(list(value))
        )
    ]
    if nested:  # a webdataset-style ``(image, text)`` batch: its fields have no names to bind
        raise user_error(
            SplitError,
            f"The example batch holds its tensors inside a list or tuple ({', '.join(nested)}): "
            "the whole-step trace binds one batch field per step parameter (or per key of a "
            "dict batch), so it finds no batched tensor.",
            fix=Fix(
                "unpack the tuple into the step's parameters (def step(image, text): ..., "
                "called with args=(image, text)) or make the batch a dict of named fields"
            ),
        )
    raise user_error(
        SplitError,
        "The example batch holds no tensor with a batch dimension.",
        fix=Fix("pass at least one batched tensor (batch along dim 0) in args/kwargs"),
    )


def _refuse_tensor_lists(inputs: dict[str, Any], batch: int) -> None:
    """Refuse a flat list or tuple of tensors that follows the batch (``[view_a, view_b]``,
    each ``(B, ...)``, or one tensor per sample): the trace binds one traced value per field and
    would hold the list at the example's length and sizes, so what the step builds from it would
    look like a per-dataset constant, stored once for every batch. ``path="auto"`` then takes
    the module-level path, which caches each batched entry along its batch dim."""
    for name, value in _named_fields(inputs):
        if type(value) not in (list, tuple) or not value:
            continue
        if not all(isinstance(item, torch.Tensor) for item in value):
            continue
        follows = len(value) == batch or any(
            item.dim() > 0 and item.shape[0] == batch for item in value
        )
        if follows:
            raise user_error(
                SplitError,
                f"The batch field {name} is a {type(value).__name__} of {len(value)} tensors "
                "that follows the batch: the whole-step trace binds one traced value per field "
                "and cannot follow a list's entries with the batch size.",
                fix=Fix(
                    'split with path="auto" (default) or path="calls": the module-level path '
                    "caches each batched entry along its batch dim; or stack the entries into "
                    "one tensor, or pass each as a field of its own"
                ),
            )


def _named_fields(inputs: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each input, and each value of a dict input (``batch['views']``)."""
    fields = []
    for name, value in inputs.items():
        if isinstance(value, dict):
            fields += [(f"{name}[{key!r}]", item) for key, item in value.items()]
        else:
            fields.append((name, value))
    return fields


def _example_values(inputs: dict[str, Any], batch: int, new_batch: int) -> dict[str, Any]:
    return {name: _example_value(value, batch, new_batch) for name, value in inputs.items()}


def _example_value(value: Any, batch: int, new_batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        shape = (new_batch, *value.shape[1:])
        return torch.empty(shape, dtype=value.dtype, device=META)
    if type(value) is dict:
        # A batch field holding a dict of batched tensors (diffusers' ControlNet-SDXL script
        # collates ``batch["unet_added_conditions"]``): its tensors grow with the batch too.
        # Left at the example's size, what the step computes from them looks the same at
        # both probe sizes, and would be planned as a per-dataset constant, stored once.
        return {key: _example_value(item, batch, new_batch) for key, item in value.items()}
    if _is_per_sample_list(value, batch):
        # One item per sample (prompt strings, SDXL's original sizes): it grows with the
        # batch like a tensor does. Left at the example's length, what the step builds from
        # it would look like a per-dataset constant and be stored once for every batch.
        return type(value)(value[i % batch] for i in range(new_batch))
    return to_meta(value)


def _is_per_sample_list(value: Any, batch: int) -> bool:
    """A plain list or tuple of Python values (no tensors) with one item per sample."""
    if type(value) not in (list, tuple) or batch < 2 or len(value) != batch:
        return False
    leaves = torch.utils._pytree.tree_leaves(list(value))
    return not any(isinstance(leaf, torch.Tensor) for leaf in leaves)


def _home_device(model: nn.Module, inputs: dict[str, Any]) -> torch.device:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and not value.is_meta:
            return value.device
    for param in model.parameters():
        if not param.is_meta:
            return param.device
    return torch.device("cpu")


def defaults_not_given(model: nn.Module, example_values: dict[str, Any]) -> dict[str, Any] | None:
    """Parameters of ``forward`` the caller did not pass keep their defaults as constants."""
    signature = inspect.signature(model.forward)
    missing = {
        name: parameter.default
        for name, parameter in signature.parameters.items()
        if name not in example_values
        and parameter.default is not inspect.Parameter.empty
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    return missing or None
