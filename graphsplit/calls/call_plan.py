"""The module-level plan: which calls stage 1 caches, under which keys, and the step's inputs.

Made once from the example batch (:mod:`.call_split`), read by the stages (:mod:`.stages`)
and the report (:mod:`.call_report`).

Inputs: a tensor crosses as it is; a list or tuple of Python numbers (IP-Adapter's
``batch["drop_image_embeds"]``) crosses as a tensor and comes back as the same list in stage 2;
a list of equal-length tuples (or lists) of numbers, one a sample (SDXL's
``batch["original_sizes"]``, ``(height, width)`` per image), crosses as a ``[B, width]`` tensor and
comes back as the same tuples; a list of strings, one a sample (captions the step tokenizes),
crosses as their code points (each plus one, zero-padded to the batch's longest: ``[B,
longest]`` int32; its boundary spec's ``pad_dim`` says so, and a cache batches rows of other
lengths padded with more zeros) and comes back as the same strings (a list named ``key``, the
batch's sample keys, crosses as ``key__text``: a cached item's own ``"key"`` is its sample
key); a tuple or list of such batched items (a
webdataset's ``(image, text)``) crosses item by item (``batch__0``, ``batch__1``); in a raw
sample (:mod:`graphsplit.planning.step.raw_samples`: DiffSynth's ``{"video": [PIL.Image, ...],
"prompt": str}``, one sample a batch) its images cross as their pixels (``images``) and a lone
string as its code points (``text``, ``[1, longest]``); any other value (a string, a flag) is a
constant of the plan, checked equal on every batch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from graphsplit.artifacts import BoundarySpec
from graphsplit.calls.module_calls import CallId, key_of
from graphsplit.calls.outputs import Structure, holds_constant, tensors_of
from graphsplit.calls.provenance import same_value
from graphsplit.calls.row_folds import RowFold
from graphsplit.calls.unstored_inputs.stand_in import batch_device, stand_in
from graphsplit.calls.verdicts import CallVerdict
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.step.raw_samples import (
    decode_images,
    encode_images,
    holds_images,
    image_mode,
    is_image,
)

NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}
# The dim of a code-point table (``[B, longest]``) along which each string ends in zeros: its
# boundary spec's ``pad_dim`` (graphsplit.artifacts.BoundarySpec).
CODE_POINT_DIM = 1


@dataclass(frozen=True)
class InputSpec:
    """One parameter of the step: ``kind`` is ``"tensor"``, ``"numbers"``, ``"rows"`` (numbers
    in rows, ``value`` the rows' type and width), ``"strings"``, ``"tensors"`` (a dict of
    batched tensors, SDXL's ``added_cond_kwargs``: each crosses as ``name__key``), ``"items"``
    (a tuple of batched items, each its own spec in ``value``), a raw sample's ``"images"``
    (``value``: their mode; ``container``: list, tuple or None for one image) and ``"text"``
    (one string), ``"unstored"`` (a batched tensor only cached calls compute with: its shape
    crosses, ``[B, ndim]`` rows ``[1, *shape[1:]]``, and stage 2 holds a stand-in; ``value``:
    its dtype), or ``"constant"``."""

    name: str
    kind: str
    container: type | None = None
    element: type | None = None
    value: Any = None

    def encode(self, value: Any) -> Any:
        """What crosses the boundary for this input's ``value``."""
        if self.kind == "numbers":
            return torch.tensor(list(value), dtype=NUMBER_DTYPES[self.element or int])
        if self.kind == "strings":
            return _code_points(value)
        if self.kind == "images":
            return encode_images(self.name, value, self.value)
        if self.kind == "text":
            return _code_points([self._text(value)])
        if self.kind == "unstored":
            return self._shape_rows(value)
        if self.kind == "rows":
            if _number_rows(value) != (self.value, self.element):
                raise user_error(
                    SplitError,
                    f"the step's input {self.name!r} is {value!r} in this batch; the module-level "
                    f"plan was made with {self.value[1]} {self.element.__name__}s a sample "  # type: ignore[index,union-attr]
                    f"in a {self.value[0].__name__}.",  # type: ignore[index]
                    fix=Fix("give every sample a row of the same width and number type"),
                )
            return torch.tensor([list(row) for row in value], dtype=NUMBER_DTYPES[self.element])
        if self.kind == "constant" and not same_value(value, self.value):
            raise user_error(
                SplitError,
                f"the step's input {self.name!r} is {value!r} in this batch; the module-level "
                f"plan was made with {self.value!r} (a non-tensor input is a constant of it).",
                fix=Fix("split with a batch that passes this value, or pass it as a tensor"),
            )
        return value

    def crossing(self, value: Any) -> dict[str, Any]:
        """The boundary entries for this input's ``value``, by boundary key."""
        if self.kind == "tensors":
            return {f"{self.name}__{key}": value[key] for key in self.value}
        if self.kind == "items":
            if type(value) is not self.container or len(value) != len(self.value):
                raise user_error(
                    SplitError,
                    f"the step's input {self.name!r} is a {type(value).__name__} of "
                    f"{_length(value)} items in this batch; the module-level plan was made "
                    f"with a {self.container.__name__} of {len(self.value)}.",  # type: ignore[union-attr]
                    fix=Fix("pass every batch in the same structure as the example batch"),
                )
            crossing = {}
            for spec, item in zip(self.value, value):
                crossing.update(spec.crossing(item) if spec.kind != "constant" else {})
                spec.encode(item)  # a constant item is checked equal
            return crossing
        return {self.field: self.encode(value)}

    @property
    def field(self) -> str:
        """This input's boundary key: its name, except that a list of strings named ``"key"``
        (the batch's sample keys, by ``cache()``'s convention) crosses as ``key__text``, so it
        never takes the place of a cached item's own ``"key"``."""
        if self.kind == "unstored":
            return f"{self.name}__shape"
        return f"{self.name}__text" if self.kind == "strings" and self.name == "key" else self.name

    def pad_dims(self) -> dict[str, int]:
        """This input's boundary keys that hold strings as code points (``[B, longest]``,
        zero past each string's end), each with the dim zeros pad it along
        (:attr:`BoundarySpec.pad_dim`): stage 2 decodes the zeros to nothing, so rows of
        different lengths batch together."""
        if self.kind in ("strings", "text"):
            return {self.field: CODE_POINT_DIM}
        if self.kind == "items":
            return {key: dim for spec in self.value for key, dim in spec.pad_dims().items()}
        return {}

    def gather(self, batch: dict[str, Any]) -> Any:
        """The value stage 2 passes the step, from its batch (a constant is not in it)."""
        if self.kind == "tensors":
            return {key: batch[f"{self.name}__{key}"] for key in self.value}
        if self.kind == "items":
            return self.container(spec.gather(batch) for spec in self.value)  # type: ignore[misc]
        if self.kind == "unstored":  # its .device: where the batch's other tensors are
            return self._stand_in(batch[self.field], batch_device(batch, self.field))
        return self.decode(batch.get(self.field))

    def present(self, batch: dict[str, Any]) -> bool:
        """Whether stage 2's batch gives this input (a constant always is)."""
        if self.kind == "tensors":
            return all(f"{self.name}__{key}" in batch for key in self.value)
        if self.kind == "items":
            return all(spec.present(batch) for spec in self.value)
        return self.field in batch or self.kind == "constant"

    def decode(self, value: Any) -> Any:
        """The value stage 2 passes the step for what crossed."""
        if self.kind == "numbers":
            items = [(self.element or int)(item) for item in value.tolist()]
            return items if self.container is list else tuple(items)
        if self.kind == "rows":
            kind, element = self.value[0], self.element
            rows = [kind(element(item) for item in row) for row in value.tolist()]
            return rows if self.container is list else tuple(rows)
        if self.kind == "strings":
            texts = ["".join(map(chr, (row[row > 0] - 1).tolist())) for row in value]
            return texts if self.container is list else tuple(texts)
        if self.kind == "images":
            return decode_images(self.name, value, self.value, self.container)
        if self.kind == "text":
            return self.decode_text(value)
        if self.kind == "unstored":
            return self._stand_in(value)
        if self.kind == "constant":
            return self.value
        return value

    def _shape_rows(self, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.dtype != self.value:
            got = (
                f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else f"a {type(value).__name__}"
            )
            raise user_error(
                SplitError,
                f"the step's input {self.name!r} is {got} in this batch; the module-level plan "
                f"was made with a batched {self.value} tensor there (not stored: only cached "
                "calls compute with it).",
                fix=Fix("give every batch this input with the example batch's dtype"),
            )
        return shape_rows(value)

    def _stand_in(self, rows: torch.Tensor, device: torch.device | None = None) -> Any:
        """The stand-in of the batch's shape, on ``device`` as far as ``.device`` reads go:
        every sample's row must be the same (samples of one batch were stacked, so they were)."""
        if rows.dim() != 2 or rows.shape[0] == 0 or not bool((rows == rows[:1]).all()):
            raise user_error(
                SplitError,
                f"the batch's samples hold the input {self.name!r} in different shapes "
                f"({sorted({tuple(row) for row in rows.tolist()})}); the step took it as one "
                "batched tensor.",
                fix=Fix("batch samples of one shape together (a bucketing sampler)"),
            )
        shape = (int(rows.shape[0]), *(int(size) for size in rows[0, 1:].tolist()))
        return stand_in(self.name, shape, self.value, device)

    def _text(self, value: Any) -> str:
        if not isinstance(value, str):
            raise user_error(
                SplitError,
                f"the sample's {self.name!r} is a {type(value).__name__} in this batch; the "
                "plan was made with a string there.",
                fix=Fix("give every sample the same fields of the same types"),
            )
        return value

    def decode_text(self, value: torch.Tensor) -> str:
        if value.dim() != 2 or value.shape[0] != 1:
            raise user_error(
                SplitError,
                f"the step takes one raw sample per batch (its example was a dataset item as it "
                f"is, with the string {self.name!r}), and this batch holds "
                f"{int(value.shape[0]) if value.dim() else 0}.",
                fix=Fix("read the cache one sample per batch: DataLoader(dataset, batch_size=1)"),
            )
        row = value[0]
        return "".join(map(chr, (row[row > 0] - 1).tolist()))


def _batched(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def input_spec(
    name: str, value: Any, batch_size: int | None = None, *, raw: bool = False
) -> InputSpec:
    """How the input ``name`` crosses, from its example value (``batch_size``: the example's,
    which a tuple's items must all have to cross item by item; ``raw``: the example is one raw
    sample, whose images and strings are the sample's own)."""
    if isinstance(value, torch.Tensor):
        return InputSpec(name, "tensor")
    if raw and holds_images(value):
        container = None if is_image(value) else type(value)
        return InputSpec(name, "images", container, value=image_mode(name, value))
    if raw and isinstance(value, str):
        return InputSpec(name, "text", str)
    if type(value) is dict and value and all(_batched(item) for item in value.values()):
        return InputSpec(name, "tensors", dict, value=tuple(value))
    if type(value) in (list, tuple) and value and _items_batched(value, batch_size):
        items = tuple(input_spec(f"{name}__{i}", item, batch_size) for i, item in enumerate(value))
        return InputSpec(name, "items", type(value), value=items)
    if isinstance(value, list | tuple) and value:
        kinds = {type(item) for item in value}
        if len(kinds) == 1 and next(iter(kinds)) in NUMBER_DTYPES:
            return InputSpec(name, "numbers", type(value), next(iter(kinds)))
        if kinds == {str} and len(value) == batch_size:  # else a constant: a fixed list
            return InputSpec(name, "strings", type(value))
        rows = _number_rows(value)
        if rows is not None and len(value) == batch_size:  # else a constant: a fixed table
            return InputSpec(name, "rows", type(value), rows[1], value=rows[0])
    return InputSpec(name, "constant", value=value)


def _number_rows(value: Any) -> tuple[tuple[type, int], type] | None:
    """``((row type, width), number type)`` when ``value`` is a list or tuple of rows, all
    tuples or all lists of one width, holding numbers of one type; else None."""
    if not isinstance(value, list | tuple) or not value:
        return None
    kinds = {type(row) for row in value}
    if len(kinds) != 1 or not kinds <= {tuple, list}:
        return None
    widths = {len(row) for row in value}
    elements = {type(item) for row in value for item in row}
    if len(widths) != 1 or len(elements) != 1 or not elements <= set(NUMBER_DTYPES):
        return None
    return (next(iter(kinds)), next(iter(widths))), next(iter(elements))


def _items_batched(value: list[Any] | tuple[Any, ...], batch_size: int | None) -> bool:
    """A tuple holding a tensor whose every item has one row a sample: a batched tensor, or a
    list of strings or numbers as long as the batch."""

    def batched(item: Any) -> bool:
        if isinstance(item, torch.Tensor):
            return item.dim() >= 1 and item.shape[0] == batch_size
        kinds = {type(part) for part in item} if isinstance(item, list | tuple) else set()
        return len(item) == batch_size and len(kinds) == 1 and kinds <= {str, *NUMBER_DTYPES}

    holds_tensor = any(isinstance(item, torch.Tensor) for item in value)
    return holds_tensor and all(batched(item) for item in value)


def _code_points(texts: Any) -> torch.Tensor:
    """Strings as ``[len(texts), longest]`` int32: each character's code point plus one, zero
    after a string's end (exact for every string, NUL included)."""
    rows = [[ord(char) + 1 for char in text] for text in texts]
    longest = max((len(row) for row in rows), default=0)
    table = torch.zeros(len(rows), longest, dtype=torch.int32)
    for index, row in enumerate(rows):
        table[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table


def _length(value: Any) -> str:
    return str(len(value)) if isinstance(value, list | tuple) else "no"


@dataclass(frozen=True)
class Unread:
    """An output field stage 2 does not compute with (:mod:`.usage`): not stored. Stage 2
    holds an :class:`~graphsplit.calls.field_reads.Unstored` stand-in of the probe's ``shape``
    and ``dtype``, or, where the step reads its shape (``shape_key``), of the batch's shape,
    stored per sample as ``[1, *shape[1:]]`` int64 under ``shape_key``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    batched: bool  # its first dimension is the batch's
    shape_key: str | None = None


@dataclass(frozen=True)
class CachedCall:
    """A cached call: its output's structure and, per stored field, the boundary key."""

    call: CallId
    structure: Structure
    keys: dict[str, str]  # output field -> boundary key
    copied: tuple[str, ...] = ()  # fields the step writes in place (stage 1 and 2 copy them)
    unread: dict[str, Unread] = dataclasses.field(default_factory=dict)
    """Output fields not stored: stage 2 never computes with them."""
    echoed: dict[str, str] = dataclasses.field(default_factory=dict)
    """Output fields that are the step's own input tensors, by input name (sentence-transformers'
    modules return the features dict they were given, ``input_ids`` and all): not stored a
    second time; their key is the input's, and stage 1 checks every call returns them so."""
    fold: RowFold | None = None
    """A call taking ``k`` rows a sample (:mod:`.row_folds`): stage 1 stores its fields
    ``[B, k, ...]``, stage 2 unfolds them to the call's ``[k * B, ...]``."""
    shared: dict[str, str] = dataclasses.field(default_factory=dict)
    """Output fields that are another stored field's very tensor (SegFormer returns
    ``last_hidden_state is hidden_states[-1]``), by that field: stored once under its key, so
    stage 2 hands out one tensor for both, as the call did; stage 1 checks every call."""

    @functools.cached_property
    def numbers(self) -> bool:
        """Whether the output holds numbers kept as constants (stage 1 checks each call's)."""
        return holds_constant(self.structure)

    def crossing(self, output: Any) -> dict[str, torch.Tensor]:
        """What stage 1 stores of the call's ``output``, by boundary key: the stored fields
        (a copy of those the step writes in place) and the shapes of unread fields whose
        shape the step reads."""
        tensors = tensors_of(output, self.structure)
        found = {
            key: tensors[field].clone() if field in self.copied else tensors[field]
            for field, key in self.keys.items()
            if field not in self.echoed and field not in self.shared
        }
        if self.fold is not None:
            found = {key: self.fold.fold(tensor) for key, tensor in found.items()}
        for field, unread in self.unread.items():
            if unread.shape_key is not None:
                found[unread.shape_key] = shape_rows(tensors[field])
        return found


def shape_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s shape, one row a sample: ``[B, ndim]`` int64 rows ``[1, *shape[1:]]``."""
    row = torch.tensor([1, *tensor.shape[1:]], dtype=torch.int64)
    return row.repeat(int(tensor.shape[0]), 1)


@dataclass(frozen=True)
class Placeholder:
    """A cached call whose output only other cached calls read (a VAE's encoder, read by its
    ``quant_conv``): not stored; stage 2 answers it with tensors on ``meta`` of ``fields``'
    shapes and dtypes, which nothing reads."""

    call: CallId
    structure: Structure
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class CallPlan:
    """Everything the stages need: inputs, cached calls, and the modules stage 2 drops."""

    signature: inspect.Signature
    inputs: tuple[InputSpec, ...]
    cached: dict[CallId, CachedCall]
    verdicts: tuple[CallVerdict, ...]
    dropped: frozenset[str]  # module paths whose calls are all answered from the cache
    boundary: dict[str, BoundarySpec]
    placeholders: dict[CallId, Placeholder] = dataclasses.field(default_factory=dict)
    unused: frozenset[str] = frozenset()
    """Frozen modules the step never computes with in stage 2 (a VAE's decoder): not held."""
    not_stored: dict[str, BoundarySpec] = dataclasses.field(default_factory=dict)
    """The cached calls' output fields stage 2 never reads, as the boundary would hold them."""
    placed: frozenset[str] = frozenset()
    """Modules not held whose weights' ``.device`` the step reads in stage 2 (diffusers'
    ``pipeline.device`` to place the captions' ids): built on meta, they would place the data
    there, so they must be built on the training device."""
    written_inputs: frozenset[str] = frozenset()
    """The crossing inputs' boundary keys the step writes in place before its last cached
    call (Whisper's SpecAugment masks ``input_features``): stage 1 stores a copy taken before
    the run, as the batch was given, or stage 2 would write its own draw over the stored one."""

    @property
    def shape_keys(self) -> list[str]:
        """The boundary keys holding an unread field's shape (the step reads its shape)."""
        return [
            unread.shape_key
            for cached in self.cached.values()
            for unread in cached.unread.values()
            if unread.shape_key is not None
        ]

    @property
    def not_held(self) -> frozenset[str]:
        """The module paths stage 2 does not hold."""
        return self.dropped | self.unused

    @property
    def last(self) -> CallId | None:
        """The cached call stage 1 stops after (the last in the step's order)."""
        return next(reversed(self.cached), None) if self.cached else None

    @functools.cached_property
    def _by_name(self) -> bool:
        """Whether every parameter can be passed by name (no ``*args``, ``**kwargs`` or
        positional-only one): then the step is called with ``**values`` (what
        ``BoundArguments`` would give, without its cost on every stage-2 step)."""
        nameable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return all(p.kind in nameable for p in self.signature.parameters.values())

    @functools.cached_property
    def unstored(self) -> tuple[str, ...]:
        """The inputs stage 2 holds a stand-in for (:mod:`.unstored_inputs`)."""
        return tuple(spec.name for spec in self.inputs if spec.kind == "unstored")

    @functools.cached_property
    def tensor_inputs(self) -> tuple[str, ...] | None:
        """The inputs' names when every one crosses as it is (a tensor), else None."""
        if all(spec.kind == "tensor" for spec in self.inputs):
            return tuple(spec.name for spec in self.inputs)
        return None

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The step's inputs by name, for a batch given as the step takes them."""
        try:
            return dict(self.signature.bind(*args, **kwargs).arguments)
        except TypeError as error:
            names = ", ".join(self.signature.parameters)
            raise user_error(
                SplitError,
                f"stage 1 takes the step's inputs ({names}) and was given "
                f"{len(args)} positional and {sorted(kwargs)} keyword values: {error}.",
                fix=Fix(
                    "pass the batch as the split names its inputs: a dict batch's fields are "
                    "the inputs, split.stage1(**batch)"
                ),
            ) from None

    def call_arguments(self, values: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` to call the step with its inputs by name."""
        if self._by_name:
            return (), values
        bound = inspect.BoundArguments(self.signature, values)  # type: ignore[arg-type]
        return bound.args, bound.kwargs


def cached_call(
    call: CallId,
    structure: Structure,
    fields: list[str],
    copied: tuple[str, ...] = (),
    unread: dict[str, Unread] | None = None,
) -> CachedCall:
    keys = {field: key_of(call, field) for field in fields}
    return CachedCall(call, structure, keys, copied, dict(unread or {}))
