"""A device or dtype read does not make frozen work per step: it is re-read off a stage-1 tensor.

Training scripts move constant inputs next to the batch: InstructPix2Pix's conditioning
dropout encodes the empty prompt, ``text_encoder(tokenize_captions([""]).to(latents.device))``,
where ``latents`` came from a random draw (``latent_dist.sample()``). The read ``latents.device``
is a node whose input is tainted (random), so the token tensor, the text encoder's call and its
output would all be tainted too: stage 2 would hold and re-run the frozen text encoder every step
for a value that is the same for the whole dataset. But a device or a dtype carries nothing of
the draw, the trainable weights or the other samples: only where and in which type the tensor
lives.

This rule re-reads such a device or dtype off a tensor stage 1 has anyway, for the frozen work
that needs it: ``latents.device`` becomes ``vae_encode_latent_dist_parameters.device`` (the
frozen VAE output the draw was made from) for the text encoder's branch, and the tainted read
stays for whatever else uses it (``torch.randint(..., device=latents.device)`` still runs in
stage 2). The frozen work is then untainted, a per-dataset constant, and the cut caches its
output once (:mod:`graphsplit.caching.format.layout`'s ``constants.safetensors``).

Glossary:
    metadata read: ``x.device`` or ``x.dtype`` (a ``getattr`` node) of a tainted tensor ``x``.
    anchor: the tensor the read moves to: the first untainted tensor (not a 0-dim one, which
        may live on the CPU beside CUDA tensors) found walking back from ``x`` through tainted
        ``call_function`` / ``call_method`` nodes that keep their inputs' device (not
        ``.to`` / ``.cuda`` / ``.cpu`` / ``.type``, no ``device=``, no module call: a module's
        hooks may move its inputs) and through untainted non-tensors computed the same way (a
        distribution object).
        A dtype read needs an anchor of the same dtype (the analysis knows both). No anchor:
        the read keeps its taint and the frozen work runs in stage 2, exact as before.
    frozen branch: the users of a read that would be untainted without it and lead to frozen
        work (:func:`~graphsplit.planning.rules.taint.is_banned`). Only those are moved, so a
        plan without such work is unchanged.

In: a graph whose nodes carry ``meta["facts"]``, the trainable parameter names. Out: the graph,
with a new read per anchored metadata read:

    anchor_metadata_reads(graph, trainable) -> tuple[fx.Node, ...]   # the new reads
    is_metadata_read(node) -> bool                                   # x.device, x.dtype
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx

from graphsplit.artifacts import Taint
from graphsplit.planning.rules.taint import compute_taint, facts, is_banned

__all__ = ["anchor_metadata_reads", "is_metadata_read"]

_METADATA_ATTRIBUTES = ("device", "dtype")
# Methods whose output may live on another device (or in another dtype) than their input.
_MOVES = frozenset({"to", "cuda", "cpu", "type", "to_empty", "pin_memory"})


def anchor_metadata_reads(graph: fx.Graph, trainable: frozenset[str]) -> tuple[fx.Node, ...]:
    """Re-read each tainted device / dtype read that frozen work needs off an anchor (see the
    module docstring); returns the reads added, in graph order."""
    taint = compute_taint(graph, trainable)
    reads = [node for node in graph.nodes if is_metadata_read(node) and node in taint]
    if not reads:
        return ()
    clean = compute_taint(graph, trainable, clean=frozenset(reads))
    feeds_frozen = _feeds_frozen_work(graph, clean)
    added: list[fx.Node] = []
    for read in reads:
        users = [user for user in read.users if user in feeds_frozen]
        if not users:
            continue
        anchor = _anchor(read, taint)
        if anchor is None:
            continue
        with graph.inserting_after(anchor):
            moved = graph.call_function(
                read.target, (anchor, read.args[1]), name=f"{anchor.name}_{read.args[1]}"
            )
        moved.meta = dict(read.meta)
        for user in users:
            user.replace_input_with(read, moved)
        added.append(moved)
    return tuple(added)


def is_metadata_read(node: fx.Node) -> bool:
    """``x.device`` or ``x.dtype``: a value that says nothing of ``x``'s values or sizes."""
    return (
        node.op == "call_function"
        and node.target is getattr
        and len(node.args) == 2
        and isinstance(node.args[0], fx.Node)
        and node.args[1] in _METADATA_ATTRIBUTES
    )


def _feeds_frozen_work(graph: fx.Graph, taint: Mapping[fx.Node, Taint]) -> set[fx.Node]:
    """Untainted nodes that are frozen work or lead to it through untainted nodes."""
    feeds: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output" or node in taint or "facts" not in node.meta:
            continue
        if is_banned(node, taint) or any(user in feeds for user in node.users):
            feeds.add(node)
    return feeds


# Functions whose results live where their tensor arguments do (unless told ``device=``): torch's,
# Python's operators and getattr, graphsplit's runtime decoders; not an opaque call of user code.
_KNOWN_PACKAGES = frozenset({"torch", "_operator", "operator", "builtins"})
_RUNTIME = "graphsplit.runtime"


def _keeps_device(node: fx.Node) -> bool:
    if "device" in node.kwargs:
        return False
    if node.op == "call_method":
        return node.target not in _MOVES
    if node.op != "call_function":
        return False
    module = getattr(node.target, "__module__", None) or ""
    return module == _RUNTIME or module.split(".")[0] in _KNOWN_PACKAGES


def _anchor(read: fx.Node, taint: Mapping[fx.Node, Taint]) -> fx.Node | None:
    """The untainted tensor the read can be re-read off, or None (see the glossary)."""
    tensor = read.args[0]
    wanted_dtype = facts(tensor).dtype
    candidates: list[fx.Node] = []
    pending, seen = [tensor], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if "facts" not in node.meta:
            return None
        node_facts = facts(node)
        if node not in taint and node_facts.is_tensor:
            if not node_facts.shape:
                return None  # a 0-dim tensor may sit on the CPU beside CUDA tensors
            if read.args[1] == "dtype" and node_facts.dtype != wanted_dtype:
                return None
            candidates.append(node)
            continue
        if node not in taint and node.op in ("placeholder", "get_attr"):
            continue  # a plain argument or attribute (a scale): it moves nothing
        if not _keeps_device(node):
            return None
        pending.extend(node.all_input_nodes)
    if not candidates:
        return None
    order = {node: index for index, node in enumerate(tensor.graph.nodes)}
    return max(candidates, key=order.__getitem__)  # the closest one to the read
