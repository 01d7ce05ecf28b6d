"""Numbers cross as numbers: sizes stage 2 reads from frozen-only data are baked, not cached.

A training step often reads a size off a raw input that only frozen work consumes:
``torch.randn(b, 4, pixel_values.shape[2] // 8, pixel_values.shape[3] // 8)`` beside a frozen
VAE, or DiffSynth's noise shaped from ``video.shape``. A size is not a tensor, so without this
module the cut would keep the whole raw input on the boundary just so stage 2 can read its
``.shape``. A plan is made for one shape anyway (the tracer bakes the ints it reads, and
:mod:`graphsplit.planning.rules.size_guards` rechecks them), so such a number is a per-dataset
constant of the plan: stage 2 holds it as a literal, and stage 1, which still has the tensor it was
read from, recomputes it on every batch and stops with "this plan was made for ..." when it differs.

Glossary:
    fixed number: an untainted Python int (not a bool), or a tuple / ``torch.Size`` of ints,
        that has the same value at both probe batch sizes (``NodeFacts.number``) and is read
        off tensors' sizes alone. Batch-size ints follow the batch and are not fixed numbers:
        stage 2 re-reads those off a cached tensor (``Cut.reanchored``). An ``int`` argument of
        the step is not one either: it may change every call (a global step).
    baked number: a fixed number the cut chose not to compute in stage 2 (``Cut.baked``):
        stage 2's code holds its value; stage 1 computes and checks it.

In: the analysis's two values of a node, a cut, the stage graphs being built. Out:

    fixed_number(value_a, value_b) -> int | tuple[int, ...] | None   # for the analysis
    is_fixed_number(node, taint) -> bool                               # for the cut
    bake_numbers(stage, cut, env) -> None        # stage 2: the literal stands for the node
    check_numbers(stage, graph, cut, env) -> None   # stage 1: recompute, check each one
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from graphsplit.artifacts import Cut, Taint
from graphsplit.planning.rules.size_guards import CheckSources, expression, insert_check, where_read
from graphsplit.planning.rules.taint import facts


def _as_number(value: Any) -> int | tuple[int, ...] | None:
    if type(value) is int:  # not bool, not a SymInt or a traced value
        return value
    is_sizes = isinstance(value, tuple) and not hasattr(value, "_fields")  # not a namedtuple
    if is_sizes and all(type(item) is int for item in value):  # a torch.Size or a plain tuple
        return value
    return None


def fixed_number(value_a: Any, value_b: Any) -> int | tuple[int, ...] | None:
    """``value_a`` when both probe runs produced the same int / tuple of ints, else None."""
    number = _as_number(value_a)
    if number is None or _as_number(value_b) is None or value_a != value_b:
        return None
    return number


def is_fixed_number(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> bool:
    """Whether the cut may bake ``node`` into stage 2 (see the glossary)."""
    node_facts = node.meta.get("facts")
    return (
        node not in taint
        and node_facts is not None
        and node_facts.number is not None
        and not node_facts.is_batch_size
        and _read_off_tensors(node)
    )


def _read_off_tensors(node: fx.Node) -> bool:
    """Whether ``node`` is computed from tensors' sizes alone: no plain input of the step (an
    ``int`` argument may change every call, e.g. a global step) and no attribute feeds it."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current in seen or facts(current).is_tensor:
            continue
        seen.add(current)
        if current.op in ("placeholder", "get_attr"):
            return False
        pending.extend(current.all_input_nodes)
    return True


def bake_numbers(stage: fx.Graph, cut: Cut, env: dict[fx.Node, Any]) -> None:
    """Let each baked number stand for its node in stage 2: copied nodes take the literal.

    An int or plain tuple becomes a literal argument (``torch.randn((b, 4, 16, 16))``); a
    ``torch.Size`` is rebuilt by one ``torch.Size(...)`` node so its methods still work.
    """
    for node, value in cut.baked.items():
        if isinstance(value, torch.Size):
            env[node] = stage.call_function(torch.Size, (list(value),), {}, name=node.name)
            env[node].meta = dict(node.meta)
        else:
            env[node] = value


def check_numbers(
    stage: fx.Graph, graph: fx.Graph, cut: Cut, env: dict[fx.Node, fx.Node], sources: CheckSources
) -> None:
    """Insert into stage 1 a check of each baked number (the cut put what it reads in stage 1).

    Stage 1 is the only stage that still has the tensor the number was read from, so a batch
    at another resolution stops here, before anything is cached, naming the user's line.
    """
    for node in graph.nodes:
        if node in cut.baked:
            expected = cut.baked[node]
            expected = tuple(expected) if isinstance(expected, tuple) else expected
            arguments = (env[node], expected, expression(node))
            insert_check(stage, env[node], arguments, where_read(node), sources)
