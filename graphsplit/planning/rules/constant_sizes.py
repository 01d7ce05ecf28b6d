"""Fix the sizes a per-dataset constant is made from: one plan's constants are one tensor each.

A per-dataset constant reads no value of the batch, so a plan computes it once and the cache
stores it once per plan (:mod:`graphsplit.caching.write.plan_constants`). It may still read the
batch's *sizes*: transformers' Llama builds ``position_ids = torch.arange(seq_len)`` and the
causal mask's ``kv_indices`` from ``inputs_embeds.shape[1]``, a size that flows through torch
ops only and so is no part of the plan's signature. One plan then served batches of two lengths
and its "constant" had two shapes: ``cache()`` stopped at the second length ("the per-dataset
constant 'position_ids' differs between batches of one plan"), and a cache of padded batches
could not be written at all.

Such a size is therefore made a size guard (:mod:`graphsplit.planning.rules.size_guards`): the
stages check it, it is part of the signature, and a batch of another length gets a plan of its
own with its own constants, as a length the step turns into a Python int already does
(padding groups, docs/howto.md). A size that follows the batch size is never guarded here: a
constant does not change with it. Nor is a size of an opaque call's output (a prompt trimmed
by ``.tolist()`` code): a guard there would make the call refuse every other length
(:func:`~graphsplit.planning.rules.opaque_call.recheck_shapes`), where the plan serves them
today; such a constant still makes ``cache()`` stop at a second length. A tensor an opaque
output is only written *into* keeps its own size: a vision-language model scatters its image
features (an opaque ``get_image_features``) into the text embeddings with ``masked_scatter``,
whose output has the shape of the embeddings, so a size read off the merged embeddings (Llama's
``position_ids`` from ``inputs_embeds.shape[1]``) is the prompt length, read from the batch,
and is guarded (:data:`SHAPE_OF_FIRST`). A device or dtype read is no size: transformers'
``DynamicLayer`` makes its empty key cache with ``torch.tensor([], device=key_states.device)``,
a constant of shape ``(0,)`` at every length, and guarding the sizes ``key_states`` was made
from gave every padded length a plan of its own.

A ``torch.Size`` read whole and given to a frozen module (Pegasus's and Marian's sinusoidal
``embed_positions(inputs_embeds.shape[:-1])``, which takes the length inside) holds no int node
to guard: its entries are made nodes of their own (``shape[i]``) and guarded, the batch size's
entry left out, so each length gets a plan, as a frozen table sliced to the length does.

Glossary:
    boundary constant: a boundary node whose facts say it is a per-dataset constant.
    size value: a plain int node read from the size of a tensor computed from the batch
        (``x.shape[1]``, ``x.size(1)``, arithmetic on them).

In: the traced graph and the cut. Out: size guards added to ``node.meta["guards"]`` of the size
values the boundary constants read:

    guard_constant_sizes(graph, cut) -> None
    computed_from_inputs(graph) -> (data, opaque)         # also read by the cut's
    size_values_read(constant, data, opaque) -> [size]    # sized_constants
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from graphsplit.artifacts import Cut, Guard
from graphsplit.planning.rules.metadata_reads import is_metadata_read
from graphsplit.planning.rules.opaque_call import is_opaque
from graphsplit.planning.rules.size_guards import GUARDS, is_size_guard, is_size_read
from graphsplit.planning.rules.taint import facts

__all__ = ["computed_from_inputs", "guard_constant_sizes", "size_values_read"]

# Ops whose output has the shape of their first argument, whatever the others hold: values
# written into a tensor (``masked_scatter``) do not give it their size.
SHAPE_OF_FIRST = frozenset({"masked_scatter", "masked_fill", "index_put", "scatter", "index_copy"})


def guard_constant_sizes(graph: fx.Graph, cut: Cut) -> None:
    """Add a size guard to every size value a boundary constant is computed from."""
    data, opaque = computed_from_inputs(graph)
    for constant in cut.boundary:
        constant_facts = constant.meta.get("facts")
        if constant_facts is None or not constant_facts.is_constant:
            continue
        for size in size_values_read(constant, data, opaque):
            for entry in [size] if isinstance(size.meta["val"], int) else _entries(size):
                guards = entry.meta.setdefault(GUARDS, [])
                if not any(is_size_guard(guard) for guard in guards):
                    value = entry.meta["val"]
                    guards.append(Guard(entry, operator.index, value, _source(constant)))


def _entries(shape: fx.Node) -> list[fx.Node]:
    """The entries of a shape value (``x.shape[:-1]``, a ``torch.Size`` given whole to a frozen
    module: Pegasus's and Marian's sinusoidal ``embed_positions(inputs_embeds.shape[:-1])``)
    that are no batch size, each as a node of its own: ``shape[i]``, what a guard can check."""
    tensor, dims = _shape_dims(shape)
    batch_dim = facts(tensor).batch_dim if "facts" in tensor.meta else None
    made = []
    for index, dim in enumerate(dims):
        if dim == batch_dim:
            continue
        with shape.graph.inserting_after(shape):
            entry = shape.graph.call_function(operator.getitem, (shape, index))
        entry.meta.update({k: v for k, v in shape.meta.items() if k in ("source", "source_code")})
        entry.meta["val"] = shape.meta["val"][index]
        entry.meta["facts"] = dataclasses.replace(
            facts(shape), type_name="int", number=entry.meta["val"]
        )
        made.append(entry)
    return made


def _shape_dims(shape: fx.Node) -> tuple[fx.Node, list[int]]:
    """The tensor a shape value reads and, per entry, the tensor's dim it holds."""
    if shape.target is operator.getitem:
        read = shape.args[0]
        assert isinstance(read, fx.Node) and isinstance(shape.args[1], slice)
        tensor, dims = _shape_dims(read)
        return tensor, dims[shape.args[1]]
    tensor = shape.args[0]
    assert isinstance(tensor, fx.Node)
    return tensor, list(range(len(shape.meta["val"])))


def size_values_read(constant: fx.Node, data: set[fx.Node], opaque: set[fx.Node]) -> list[fx.Node]:
    """The size values among ``constant``'s ancestors, the first read of each size only; none
    read from an opaque call's output or upstream of it."""
    found, seen, todo = [], set(), list(constant.all_input_nodes)
    while todo:
        node = todo.pop()
        if node in seen or node in opaque:
            continue
        seen.add(node)
        if _is_size_value(node, data):
            found.append(node)
            continue  # its own inputs are the tensor whose size it reads
        if is_metadata_read(node):
            continue  # a device or dtype is the same at every length
        todo.extend(node.all_input_nodes)
    return sorted(found, key=_position(constant.graph))


def _is_size_value(node: fx.Node, data: set[fx.Node]) -> bool:
    value = node.meta.get("val")
    if _is_shape_read(node):
        return node in data  # a torch.Size read whole: its entries are guarded
    if isinstance(value, bool) or not isinstance(value, int) or node not in data:
        return False
    node_facts = node.meta.get("facts")
    if node_facts is not None and node_facts.is_batch_size:
        return False
    return node.op in ("call_function", "call_method")


def computed_from_inputs(graph: fx.Graph) -> tuple[set[fx.Node], set[fx.Node]]:
    """The nodes computed from the step's inputs; apart, those whose size may come from an
    opaque call (computed from one, except through the values of a :data:`SHAPE_OF_FIRST`)."""
    data: set[fx.Node] = set()
    opaque: set[fx.Node] = set()
    for node in graph.nodes:
        sized_by = node.all_input_nodes
        if _writes_into_first(node):
            sized_by = [node.args[0]]
        if is_opaque(node) or any(arg in opaque for arg in sized_by):
            opaque.add(node)
        elif node.op == "placeholder" or any(arg in data for arg in node.all_input_nodes):
            data.add(node)
    return data, opaque


def _writes_into_first(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (
        node.op in ("call_method", "call_function")
        and str(name).removesuffix("_") in SHAPE_OF_FIRST
        and bool(node.args)
        and isinstance(node.args[0], fx.Node)
    )


def _is_shape_read(node: fx.Node) -> bool:
    """``x.shape``, ``x.size()`` or a slice of either: a ``torch.Size`` of a tensor's dims."""
    if not isinstance(node.meta.get("val"), torch.Size):
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        inner = node.args[0]
        sliced = isinstance(node.args[1], slice)
        return sliced and isinstance(inner, fx.Node) and _is_shape_read(inner)
    return is_size_read(node) and isinstance(node.args[0], fx.Node)


def _position(graph: fx.Graph):
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


def _source(node: fx.Node) -> str:
    return str(node.meta.get("source", "<unknown>"))
