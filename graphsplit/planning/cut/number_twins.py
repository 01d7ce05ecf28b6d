"""A baked number equal to a size of a boundary tensor made from the same input is read off it.

The cut bakes into stage 2, as a literal, each number stage 2 needs from data it does not have
(:mod:`graphsplit.planning.rules.baked_sizes`), and stage 1 checks it: a plan per value. Many
of them are a size of the batch that a cached tensor holds too, under another name.
DiffSynth's Wan step draws its noise as ``randn((1, z_dim, (num_frames - 1) // 4 + 1,
height // 8, width // 8))`` from the raw video, while the cached latents, the VAE's encoding
of that video, have exactly those sizes: every frame count was a plan of its own. A Bloom-style
ALiBi bias ``(B, heads, L)`` made from the attention mask holds the mask's length at index 2,
where :mod:`~graphsplit.planning.cut.twin_reads` (which makes the read itself, ``mask.shape[1]``,
on a twin) finds no tensor with the length at index 1.

Stage 2 reads such a number off its *number twin*, ``twin.size(dim)``; stage 1, which computes
the number as the step does, checks on every batch that the two agree
(:func:`graphsplit.runtime.check_same_read`). A batch where they differ stops with a
:class:`~graphsplit.runtime.PlanMismatch` before anything is cached, and the dispatcher makes it
a plan of its own, with the number baked: every step stays exact, and one plan serves every size
for which the equality holds.

Glossary:
    sources: the tensors whose sizes a number reads (``video`` for Wan's frame count), found
        by walking back from the number through non-tensor nodes; each must be read by a
        metadata read alone (``x.shape``, ``x.size(2)``): a number made from a tensor's values
        is left baked.
    number twin: a per-sample boundary tensor computed from every source, and one of its
        dimensions other than the batch's, whose size at the example is the number. Where more
        than one dimension qualifies (Wan's ``height // 8`` and ``width // 8`` at a square
        example), the one at the number's position in a shape of the twin's rank that the
        number is given to (``randn((1, 16, frames, h, w))``: index 3 for ``h``) is taken; with
        no such position the twin is ambiguous and the next is tried. The nearest twin after
        the sources in the graph is chosen.

Numbers 0 and 1 are left baked: sizes of one are everywhere (a kept dim, one channel), and a
twin chosen by such a coincidence would turn every later batch into a plan of its own.

In and out::

    numbers_on_twins(cut, numbers) -> {number: (twin, dim)}      # choose_boundary asks
    check_number_twins(stage, cut, env, sources) -> None         # stage 1's checks
    size_on_twin(stage, number, twin, dim) -> node               # stage 2's read
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphsplit.artifacts import Cut
from graphsplit.planning.cut.twin_reads import computed_from, is_read
from graphsplit.planning.rules.node_inputs import reads_through
from graphsplit.planning.rules.size_guards import CheckSources, expression, insert_check, where_read
from graphsplit.planning.rules.taint import facts
from graphsplit.runtime import check_same_read

__all__ = ["check_number_twins", "numbers_on_twins", "size_on_twin"]

# The smallest number read off a twin (see the module docstring).
SMALLEST = 2


def numbers_on_twins(cut: Cut, numbers: Iterable[fx.Node]) -> dict[fx.Node, tuple[fx.Node, int]]:
    """``{number: (twin, dim)}`` for each of ``numbers`` (baked ones) that has a number twin."""
    found: dict[fx.Node, tuple[fx.Node, int]] = {}
    for number in numbers:
        value = cut.baked.get(number)
        if type(value) is not int or value < SMALLEST:
            continue
        sources = _sources(number)
        if sources:
            twin = _twin(number, value, sources, cut.boundary)
            if twin is not None:
                found[number] = twin
    return found


def _sources(number: fx.Node) -> set[fx.Node] | None:
    """The tensors whose sizes ``number`` reads, or None when it reads a tensor otherwise."""
    passed, ends = reads_through(number, lambda node: not _is_tensor(node))
    if not ends or any(node.op == "placeholder" for node in passed):
        return None  # reads no tensor, or a number given to the step
    for end in ends:
        readers = [user for user in end.users if user in passed or user is number]
        if not readers or not all(is_read(reader, end) for reader in readers):
            return None
    return ends


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _twin(
    number: fx.Node, value: int, sources: set[fx.Node], boundary: Sequence[fx.Node]
) -> tuple[fx.Node, int] | None:
    position = {node: index for index, node in enumerate(number.graph.nodes)}
    candidates = sorted(
        (node for node in boundary if _per_sample_tensor(node)), key=position.__getitem__
    )
    for twin in candidates:
        if not all(computed_from(twin, source, position) for source in sources):
            continue
        shape = twin.meta["val"].shape
        batch_dim = facts(twin).batch_dim
        dims = [d for d, size in enumerate(shape) if d != batch_dim and _equals(size, value)]
        if len(dims) > 1:
            aligned = _aligned_dims(number, len(shape))
            dims = [d for d in dims if d in aligned]
        if len(dims) == 1:
            return twin, dims[0]
    return None


def _per_sample_tensor(node: fx.Node) -> bool:
    return "facts" in node.meta and facts(node).per_sample and _is_tensor(node)


def _equals(size: Any, value: int) -> bool:
    return type(size) is int and size == value


def _aligned_dims(number: fx.Node, rank: int) -> set[int]:
    """The indices at which ``number`` stands in a shape of ``rank`` entries it is given to:
    a tuple or list argument (``randn((1, 16, f, h, w))``) or a method's size arguments
    (``x.view(b, c, f, h, w)``)."""
    shapes: list[Sequence[Any]] = []
    for user in number.users:
        shapes += [a for a in (*user.args, *user.kwargs.values()) if isinstance(a, (tuple, list))]
        if user.op == "call_method":
            shapes.append(user.args[1:])
    return {
        index
        for shape in shapes
        if len(shape) == rank
        for index, entry in enumerate(shape)
        if entry is number
    }


def size_on_twin(stage: fx.Graph, number: fx.Node, twin: fx.Node, dim: int) -> fx.Node:
    """``twin.size(dim)`` in ``stage`` (``twin`` one of its nodes), standing for ``number``."""
    made = stage.create_node("call_method", "size", (twin, dim), name=number.name)
    made.meta = dict(number.meta)
    return made


def check_number_twins(
    stage: fx.Graph, cut: Cut, env: dict[fx.Node, fx.Node], sources: CheckSources
) -> None:
    """Insert into stage 1 the check of each number stage 2 reads off a twin: the number as
    the step computes it and the twin's size must agree for the batch."""
    # The nodes' order before any check is inserted: only nodes that were there are compared.
    order = {node: index for index, node in enumerate(stage.nodes)}
    for number, (twin, dim) in cut.number_twins.items():
        later = max((env[number], env[twin]), key=order.__getitem__)
        with stage.inserting_after(later):
            on_twin = size_on_twin(stage, number, env[twin], dim)
        what = f"{expression(twin)}.shape[{dim}]"
        arguments = (on_twin, env[number], expression(number), what)
        insert_check(stage, on_twin, arguments, where_read(number), sources, check_same_read)
