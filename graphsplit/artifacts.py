"""The typed hand-offs between graphsplit's pipeline steps: small frozen dataclasses and enums.

Glossary:
    boundary value: a tensor computed by stage 1 and consumed by stage 2; the cache stores it.
    batch dim: the dimension of a boundary tensor that indexes samples; ``None`` marks a
        per-dataset constant (computed from frozen weights alone, stored once).
    batch layout: how a node's value relates to the batch (:class:`BatchLayout`): one row per
        sample along ``batch_dim``, constant across batch sizes, or neither (unknown).
    bytes per sample: what one sample of a boundary value costs on disk.
    source: the user's ``file:line`` that produced a value (``node.meta["source"]``), for
        reports and errors.
    taint: why a node must run in stage 2 (:class:`Taint`, its kind a :class:`TaintKind`).

The pipeline, and the artifact each step hands to the next::

    planning.step.example_inputs.bind_examples(model, args, kwargs) -> ExampleInputs
    planning.tracing.tracer.trace_step(model, values, leaves)    -> Traced (graph, guards,
    constants) planning.analyse.node_facts.analyze(traced, model, examples)   -> node.meta["facts"]
    = NodeFacts planning.cut.boundary.choose_boundary(graph, trainable)      -> Cut (boundary,
    stages, Taint per node,
                                                           Recomputation: frozen work redone)
    planning.codegen.stages.build_stage1 / build_stage2        -> torch.fx.GraphModule each

Node facts are never mutated: an update is ``dataclasses.replace(facts, ...)`` written back to
``node.meta["facts"]``. :class:`BoundarySpec` is public and serialises to JSON.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


@dataclass(frozen=True)
class BoundarySpec:
    """One tensor that crosses from stage 1 to stage 2.

    ``shape`` is the shape seen at trace time (the example batch); ``shape[batch_dim]`` varies
    with the batch size, the other dims may vary between samples (aspect-ratio buckets).

    ``pad_dim``: the dim along which the tensor's values end in zeros that carry nothing, so
    that rows of different sizes there batch together padded with zeros: a batch of strings as
    code points (each plus one, zero past a string's end: the module-level path's captions),
    whose width is the longest string of the batch stage 1 saw, not a property of a sample.
    None for every other tensor, where a zero is a value.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    batch_dim: int | None
    bytes_per_sample: int
    source: str
    pad_dim: int | None = None

    @property
    def is_constant(self) -> bool:
        """True for a per-dataset constant, stored once rather than per sample."""
        return self.batch_dim is None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; ``dtype`` as its name without the ``torch.`` prefix; ``pad_dim``
        only where set (the dict of every other tensor is as it was before the field)."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch_dim": self.batch_dim,
            "bytes_per_sample": self.bytes_per_sample,
            "source": self.source,
            **({} if self.pad_dim is None else {"pad_dim": self.pad_dim}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BoundarySpec:
        """Inverse of :meth:`to_json`; raises ``ValueError`` on an unknown dtype."""
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {data['dtype']!r} in boundary spec {data['name']!r}")
        batch_dim = data["batch_dim"]
        return cls(
            name=str(data["name"]),
            shape=tuple(int(size) for size in data["shape"]),
            dtype=dtype,
            batch_dim=None if batch_dim is None else int(batch_dim),
            bytes_per_sample=int(data["bytes_per_sample"]),
            source=str(data["source"]),
            pad_dim=None if data.get("pad_dim") is None else int(data["pad_dim"]),
        )


# -- bind inputs -> trace ---------------------------------------------------------------------
@dataclass(frozen=True)
class ExampleInputs:
    """The example batch bound to ``forward``'s parameters, and its meta twins at two sizes.

    ``values[i]`` maps each parameter name to a meta value whose batched tensors have
    ``batch_sizes[i]`` rows; ``device`` is where the step really runs.
    """

    inputs: Mapping[str, Any]
    batch_sizes: tuple[int, int]
    values: tuple[Mapping[str, Any], Mapping[str, Any]]
    device: torch.device


# -- trace -> analyze -------------------------------------------------------------------------
@dataclass(frozen=True)
class Guard:
    """A Python value the traced code derived from a meta value, e.g. ``len(x.shape)``."""

    node: fx.Node
    convert: Callable[[Any], Any]
    value: Any
    source: str


@dataclass(frozen=True)
class Traced:
    """The traced step: ``graph`` references the model's attributes and ``constants`` by name.

    ``notes`` are for the report: which modules the planning traced into, or kept whole.
    """

    graph: fx.Graph
    constants: Mapping[str, torch.Tensor]
    guards: tuple[Guard, ...]
    input_names: tuple[str, ...]
    notes: tuple[str, ...] = ()
    # The batch sizes the plan was analysed at, when not the example's probe sizes: (1, 1) for
    # a plan that runs one sample per batch (see
    # graphsplit.planning.step.example_inputs.ONE_SAMPLE).
    batch_sizes: tuple[int, int] | None = None
    # Leaves a round meant to trace into and kept whole because tracing into them failed, or
    # because the finer graph had no valid cut (BertForMultipleChoice's BERT on batch x choices
    # rows): their frozen work may run in stage 2 only because of that.
    kept_whole: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AtenOp:
    """One ATen op a node ran on meta tensors, as recorded for the analysis.

    ``dims`` holds the ``dim``/``dims`` argument of ops that work along a dimension (see
    :data:`graphsplit.planning.rules.mixing.ALONG_DIM_OPS`), empty for the others.
    """

    name: str
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    draws_random: bool
    dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class OpRecord:
    """What one node ran: its ATen ops and their FLOPs (matmul, convolution, attention)."""

    ops: tuple[AtenOp, ...]
    flops: int


# -- analyze -> cut ---------------------------------------------------------------------------
class BatchLayout(enum.Enum):
    """How a node's value relates to the batch, found by running the step at two batch sizes."""

    PER_SAMPLE = "per-sample"  # one row per sample along ``NodeFacts.batch_dim``
    CONSTANT = "constant"  # no dimension follows the batch size
    # Follows the batch size but not as one row per sample along one dim (``(2B, ...)``, a
    # flattened batch, a row per batch position), or is no tensor: never cached per sample.
    UNKNOWN = "unknown"


class MixingCause(enum.Enum):
    """Why a node's value for one sample depends on the other samples of its batch."""

    DIFFERENT_OPS = "runs different operations at different batch sizes"
    BATCH_NORM_TRAINING = "BatchNorm in train mode normalises with batch statistics"
    ACROSS_BATCH = "reduces or selects across the batch"
    ALONG_BATCH = "moves values along the batch dimension"
    NO_BATCH_DIM = "its value depends on the batch's data but has no batch dimension"


@dataclass(frozen=True)
class Mixing:
    """A typed mixing verdict; ``op`` names the ATen op for the causes that come from one."""

    cause: MixingCause
    op: str | None = None

    def __str__(self) -> str:
        return f"aten.{self.op} {self.cause.value}" if self.op else self.cause.value


@dataclass(frozen=True)
class NodeFacts:
    """What graphsplit knows about one node's value and op (``node.meta["facts"]``)."""

    is_tensor: bool
    type_name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    batch_layout: BatchLayout
    batch_dim: int | None  # the sample dimension when ``batch_layout`` is PER_SAMPLE
    bytes_per_sample: int
    total_bytes: int
    depends_on_data: bool
    flops: int = 0
    random_ops: tuple[str, ...] = ()
    mixing: Mixing | None = None  # why the node mixes samples, or None
    params: frozenset[str] = frozenset()  # parameters the node reads directly (qualified names)
    is_batch_size: bool = False  # a Python int equal to the batch size in both runs
    # A Python int (or tuple / torch.Size of ints) equal in both runs: a resolution, a frame
    # count, never the batch size; None for anything else (see
    # graphsplit.planning.rules.baked_sizes).
    number: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert (self.batch_dim is not None) == (self.batch_layout is BatchLayout.PER_SAMPLE), (
            f"batch_dim {self.batch_dim} does not match the layout {self.batch_layout}"
        )

    @property
    def per_sample(self) -> bool:
        return self.batch_layout is BatchLayout.PER_SAMPLE

    @property
    def is_constant(self) -> bool:
        return self.batch_layout is BatchLayout.CONSTANT and not self.depends_on_data


# -- cut -> codegen, report -------------------------------------------------------------------
class TaintKind(str, enum.Enum):
    """The three reasons a node must run in stage 2 every step."""

    TRAINABLE = "trainable"
    RANDOM = "random"
    MIXING = "mixing"


@dataclass(frozen=True)
class Taint:
    """Why a node must run in stage 2; ``origin`` is the node whose own property caused it.

    Exactly one of ``trainable_parameters`` / ``random_ops`` / ``mixing`` is set, per ``kind``.
    """

    kind: TaintKind
    origin: fx.Node
    trainable_parameters: tuple[str, ...] = ()  # sorted qualified names the origin reads
    random_ops: tuple[str, ...] = ()
    mixing: Mixing | None = None

    @property
    def reason(self) -> str:
        """The cause in words, for the report (never parsed: decide on the typed fields)."""
        if self.kind is TaintKind.TRAINABLE:
            first, count = self.trainable_parameters[0], len(self.trainable_parameters)
            more = f" (and {count - 1} more)" if count > 1 else ""
            return f"trainable: reads trainable parameter {first}{more}"
        if self.kind is TaintKind.RANDOM:
            return f"random: draws random numbers ({', '.join(self.random_ops)})"
        return f"mixing: mixes samples of the batch ({self.mixing})"


@dataclass(frozen=True)
class Recomputation:
    """The store-or-recompute trade a cut made (``recompute="auto"``), against the plan that
    caches all frozen work (``recompute="never"``).

    ``nodes``: the frozen work stage 2 redoes, in graph order. ``bytes_saved_per_sample``: the
    boundary's bytes per sample under "never" minus under this plan; None when "never" has no
    exact split at all (a frozen layer's output cannot be cached, but can be redone).
    ``flops_per_sample``: the FLOPs stage 2 adds by redoing ``nodes``. ``weights``: the frozen
    parameters stage 2 holds only because of the trade (sorted qualified names),
    ``weight_bytes`` their size.
    """

    nodes: tuple[fx.Node, ...]
    bytes_saved_per_sample: int | None
    flops_per_sample: int
    weights: tuple[str, ...]
    weight_bytes: int


@dataclass(frozen=True)
class Cut:
    """The chosen boundary and the nodes each stage runs (a cheap node may be in both)."""

    boundary: tuple[fx.Node, ...]
    stage1: frozenset[fx.Node]
    stage2: frozenset[fx.Node]
    taint: Mapping[fx.Node, Taint] = field(default_factory=dict)
    # Batch-size values stage 2 reads off a cached tensor (``anchor.size(batch_dim)``) because
    # the tensor they came from is not in stage 2.
    reanchored: frozenset[fx.Node] = frozenset()
    anchor: fx.Node | None = None
    # Numbers stage 2 needs from frozen-only data, baked into stage 2 as the literal value
    # (node -> value) and rechecked in stage 1, which still has what they were read from.
    baked: Mapping[fx.Node, Any] = field(default_factory=dict)
    # Frozen work stage 2 redoes instead of reading it from the cache (``recompute="auto"``),
    # and the trade that bought it; None when stage 2 redoes no frozen work.
    recomputation: Recomputation | None = None
    # Reads of a tensor stage 2 does not have (``inputs_embeds.shape``) that stage 2 makes on a
    # boundary tensor computed from it instead (read -> that tensor), checked in stage 1
    # (graphsplit.planning.cut.twin_reads).
    twin_reads: Mapping[fx.Node, fx.Node] = field(default_factory=dict)
    # Numbers stage 2 reads as a size of a boundary tensor made from what they were read from
    # (number -> (tensor, dim)) instead of baking them, checked in stage 1
    # (graphsplit.planning.cut.number_twins).
    number_twins: Mapping[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)


# -- split -> cache, loader ---------------------------------------------------------------------
@dataclass(frozen=True)
class PairedRows:
    """Stage 2 combines rows of its batch by their position (a preference step's
    ``[chosen; rejected]`` rows, ``logps.chunk(2)`` then ``chosen - rejected``): regrouping the
    cached rows into other batches would pair the wrong rows, so a cache of such a split is read
    in the batches stage 1 cached, whole (:mod:`graphsplit.row_pairing` finds it).

    ``op`` is the ATen op where rows of different positions first meet, ``source`` the user's
    ``file:line`` that ran it ("" when unknown), ``groups`` the example batch's rows that meet
    there (by position, each group sorted), ``rows`` the example batch's row count.
    """

    op: str
    source: str
    groups: tuple[tuple[int, ...], ...]
    rows: int

    def describe(self) -> str:
        """One line for messages and reports."""
        shown = ", ".join("{" + ", ".join(map(str, group)) + "}" for group in self.groups[:4])
        more = " ..." if len(self.groups) > 4 else ""
        where = f" at {self.source}" if self.source else ""
        return (
            f"stage 2 combines rows of its batch by position (aten.{self.op}{where}: rows "
            f"{shown}{more} of the example's {self.rows} meet)"
        )

    def report_lines(self) -> list[str]:
        """The section ``report()`` shows for it."""
        return [
            "",
            "Rows paired by position: a cache of this split is read in the batches stage 1 "
            "cached, whole (regrouped rows would pair the wrong ones):",
            f"  {self.describe()}",
        ]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``plan.json``'s ``paired_rows``)."""
        return {
            "op": self.op,
            "source": self.source,
            "groups": [list(group) for group in self.groups],
            "rows": self.rows,
        }


class PairedRowsOnDemand:
    """``paired_rows`` found on first read, not by ``split()``: finding it runs stage 2 on the
    example once per row (:mod:`graphsplit.row_pairing`), which only a cache, ``report()`` or
    ``to_json()`` needs. The class mixing it in holds ``_paired_rows`` and
    ``_find_paired_rows`` (the call that finds it, dropped once made); setting
    ``paired_rows`` replaces both."""

    _paired_rows: PairedRows | None
    _find_paired_rows: Callable[[], PairedRows | None] | None

    @property
    def paired_rows(self) -> PairedRows | None:
        """Where stage 2 pairs rows of its batch by position; None where it does not, or
        where that cannot be told (:mod:`graphsplit.row_pairing`)."""
        if self._find_paired_rows is not None:
            # Dropped only once made: an interrupted first read (Ctrl-C) leaves it to find.
            self._paired_rows = self._find_paired_rows()
            self._find_paired_rows = None
        return self._paired_rows

    @paired_rows.setter
    def paired_rows(self, value: PairedRows | None) -> None:
        self._find_paired_rows = None
        self._paired_rows = value
