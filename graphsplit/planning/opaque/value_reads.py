"""Frozen value reads: a Python value read off frozen data is the example's, checked in stage 1.

DiffSynth's ``model_fn_qwen_image`` starts with ``txt_seq_lens = prompt_emb_mask.sum(dim=1)
.tolist()`` and slices its RoPE table with ``max(txt_seq_lens)``. The function also runs the
trainable DiT, so it cannot run eagerly in stage 1 as one opaque step
(:mod:`graphsplit.planning.opaque.sites`), and the mask is frozen data that differs per sample.
Planned one sample per batch, the read is answered instead: the tensor is computed for real on
the example batch (the example run of :mod:`graphsplit.planning.opaque.example_run`, real frozen
weights), the user's code gets the Python value eager would get, and the plan holds that value
as a literal wherever the code used it, as a plan holds the sizes it was traced at
(:mod:`graphsplit.planning.rules.baked_sizes`). Exactness comes from a check: the graph gets one
``check_value(tensor, read, value, where)`` node, which the cut always puts in stage 1
(:func:`value_checks`), so stage 1 recomputes the tensor on every batch and stops with "this
plan was made for the value [187] ..." naming the user's line when it reads another value.

Glossary:
    value read: Python reading a traced tensor's value: ``.tolist()``, ``.item()``, ``bool()``,
        ``int()``, ``float()``, or ``__index__`` (a 0-dim tensor as a slice bound).
    answered read: a value read at a line the planning listed (``lines``), because making the
        code around it opaque failed (:mod:`graphsplit.planning.leaf_rounds` decides): the tensor
        must not depend on a trainable parameter or a random draw, and the plan must be one
        sample per batch (a batch's value is one sample's), or made from an example of several
        samples that each read the same value (a ``.tolist()`` of a per-sample tensor, every
        row equal: one plan per value, the data bucketed by it; docs/algorithm.md, 5b).
    value check: the ``check_value`` node recording an answered read (``is_value_check``).

A plan holding the example's value refuses, in stage 1, every sample that reads another value:
Qwen-Image's prompt length is such a value, so one plan serves the samples of one prompt length
(see docs/algorithm.md, "Frozen value reads", for what that costs and what is not built).

In: the tracer's proxy of the tensor being read; the lines to answer and the example run, set
for one trace by :func:`frozen_value_reads`. Out:

    frozen_value_reads(run, lines) -> context manager      # rounds.py: around one trace
    answer(tracer, proxy, read) -> value | NOT_ANSWERED    # trace.py: at the read
    value_checks(graph) -> list of check nodes             # cut.py: stage 1 runs them
    check_value_reads(graph, trainable)                    # after the analysis: untainted
    hold_check_sources(stage, sources)                     # stage 1: lines beside the code
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphsplit.errors import Fix, TensorValueError, user_error
from graphsplit.planning.opaque.example_run import ExampleRun
from graphsplit.planning.opaque.site_types import VALUE_FIX, ValueSite
from graphsplit.planning.rules.size_guards import CheckSources
from graphsplit.planning.rules.taint import compute_taint
from graphsplit.planning.rules.user_lines import current_line, describe
from graphsplit.planning.step.example_inputs import example_batch_size
from graphsplit.runtime import _VALUE_READS as VALUE_READS
from graphsplit.runtime import check_value

# What a node's meta holds for an answered read (see the module docstring).
VALUE_READ = "value_read"


class Read(enum.Enum):
    """How Python read the value; the value is the name ``check_value`` is written with."""

    TOLIST = "tolist"
    ITEM = "item"
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    INDEX = "index"

    def apply(self, tensor: torch.Tensor) -> Any:
        """What eager Python gets from ``tensor`` read this way: the same table stage 1's
        ``check_value`` reads with, so the plan's value and the check's agree by construction."""
        return VALUE_READS[self.value](tensor)


@dataclass(frozen=True)
class AnsweredRead:
    """One answered read, for the report: the line, how it read, the value the plan holds."""

    read_at: str
    read: Read
    value: Any


NOT_ANSWERED = object()
"""What :func:`answer` returns when this read is not one to answer: the tracer refuses it."""


@dataclass(frozen=True)
class _Answering:
    run: ExampleRun
    lines: frozenset[str]


_ANSWERING: ContextVar[_Answering | None] = ContextVar("graphsplit_value_reads", default=None)


@contextlib.contextmanager
def frozen_value_reads(run: ExampleRun, lines: frozenset[str]) -> Iterator[None]:
    """Answer the value reads at ``lines`` (``file:line  code``) during one trace."""
    token = _ANSWERING.set(_Answering(run, lines) if lines else None)
    try:
        yield
    finally:
        _ANSWERING.reset(token)


def answer(tracer: Any, proxy: fx.Proxy, read: Read) -> Any:
    """The value eager reads here, and a ``check_value`` node; or :data:`NOT_ANSWERED`.

    Refused with a :class:`~graphsplit.errors.TensorValueError` naming the line when the
    tensor depends on a trainable parameter or a random draw: then its value changes every
    step, and no plan can hold it.
    """
    answering = _ANSWERING.get()
    if answering is None:
        return NOT_ANSWERED
    read_at = current_line()
    if read_at not in answering.lines:
        return NOT_ANSWERED
    node = proxy.node
    run = answering.run
    tainting = run.tainting_ancestor(run.computed_from(node))
    if tainting is not None:
        ancestor, why = tainting
        error = user_error(
            TensorValueError,
            f"The step reads the value of a tensor ({_read_text(read)}) that depends on {why} "
            f"({ancestor.name}, {describe((ancestor.meta.get('source', '?'), ''))}): the value "
            "changes every step, so no plan can hold it, and value-dependent code on the "
            "trainable side cannot be split.",
            node=node,
            source=read_at,
            fix=VALUE_FIX,
        )
        error.read_at = read_at
        raise error
    tracer.computing_meta = True  # a real run: module calls run their forward, untraced
    try:
        real = run.real_value(node, ValueSite("this line", read_at))
    finally:
        tracer.computing_meta = False
    value = read.apply(real)
    batch = example_batch_size(run.examples)
    if batch > 1:
        _refuse_a_batch_value(real, read, batch, node, read_at)
    arguments = (proxy, read.value, value, read_at)
    check = tracer.create_proxy("call_function", check_value, arguments, {})
    check.node.meta[VALUE_READ] = AnsweredRead(read_at, read, value)
    return value


BUCKET_FIX = (
    "bucket the loader by this value, so that every sample of a batch reads the same (e.g. "
    "by prompt length), or feed one sample per batch"
)


def _refuse_a_batch_value(
    real: torch.Tensor, read: Read, batch: int, node: fx.Node, read_at: str
) -> None:
    """At several samples per batch, answer only a per-sample list every sample agrees on.

    Stage 2 trains on batches regrouped from cached rows: a plan holding ``[3, 5]`` would be
    wrong for its rows in another order, and a value of the whole batch for any regrouping.
    A ``.tolist()`` of a tensor with one row per sample, every row equal, means "each sample
    reads v": any batch of such rows, of the plan's size, reads the same list.
    """
    uniform = (
        read is Read.TOLIST
        and isinstance(real, torch.Tensor)
        and real.dim() >= 1
        and real.shape[0] == batch
        and bool(torch.equal(real, real[:1].expand_as(real)))
    )
    if uniform:
        return
    error = user_error(
        TensorValueError,
        f"The step reads a value of frozen data ({_read_text(read)}) that the plan would hold, "
        f"and the example batch of {batch} samples does not read one value per sample that "
        "every sample shares: a plan holding it would be wrong for stage 2's batches, which "
        "regroup the cached samples.",
        node=node,
        source=read_at,
        fix=Fix(BUCKET_FIX),
    )
    error.read_at = read_at
    error.not_shared = True  # type: ignore[attr-defined]  # leaf_rounds shows this refusal
    raise error


def _read_text(read: Read) -> str:
    return f".{read.value}()" if read in (Read.TOLIST, Read.ITEM) else f"{read.value}()"


def is_value_check(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is check_value


def value_checks(graph: fx.Graph) -> list[fx.Node]:
    """The graph's value checks: stage 1 runs each (it has no user; nothing else would)."""
    return [node for node in graph.nodes if is_value_check(node)]


def answered_reads(graph: fx.Graph) -> list[AnsweredRead]:
    return [node.meta[VALUE_READ] for node in value_checks(graph)]


def check_value_reads(
    graph: fx.Graph, trainable: frozenset[str], *, several_samples: bool = False
) -> None:
    """Refuse an answered read the analysis found tainted (its value would change per step),
    and, with several samples per batch, one whose tensor is not per sample along dim 0.

    The read was answered from what the graph showed at the time; the analysis sees the whole
    graph and every probe run (a mixing op, a trainable parameter read in a leaf module).
    """
    taint = compute_taint(graph, trainable)
    for node in value_checks(graph):
        facts = node.args[0].meta.get("facts") if isinstance(node.args[0], fx.Node) else None
        if several_samples and (facts is None or facts.batch_dim != 0 or facts.mixing is not None):
            answered = node.meta[VALUE_READ]
            raise user_error(
                TensorValueError,
                f"The step reads a value of frozen data ({_read_text(answered.read)}) whose "
                "tensor mixes the samples of the batch (or has no sample dim first): a plan "
                "holding it would be wrong for stage 2's batches, which regroup the cached "
                "samples.",
                node=node,
                source=answered.read_at,
                fix=Fix(BUCKET_FIX),
            )
        if node in taint:
            answered = node.meta[VALUE_READ]
            raise user_error(
                TensorValueError,
                f"The step reads the value of a tensor ({_read_text(answered.read)}) whose "
                f"value must be computed every step ({taint[node].reason}); no plan can hold "
                "it.",
                node=node,
                source=answered.read_at,
                fix=VALUE_FIX,
            )


def hold_check_sources(stage: fx.Graph, sources: CheckSources) -> None:
    """Stage 1's value checks read their line from ``sources``, not from the code.

    Stage 1's code is part of the cache fingerprint; a ``file:line`` written into it would make
    a cache stale when the user's script gains a line above the read.
    """
    for node in [n for n in stage.nodes if is_value_check(n)]:
        tensor, read, value, where = node.args
        if isinstance(where, str):
            node.args = (tensor, read, value, sources.node_for(where, tensor))
