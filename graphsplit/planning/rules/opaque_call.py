"""The callable behind an opaque node: one call of frozen, value-dependent code, run eagerly.

Glossary:
    opaque call: a call of a user or library function that reads tensor values (a loop over
        ``.tolist()``, a boolean-mask gather, a slice bound read from a tensor), recorded as one
        ``call_function`` node whose target is an :class:`OpaqueCall`. Stage 1 runs it on the
        real batch (one generated line: ``encode_prompt = wan_video_encode_prompt(ids, mask)``);
        stage 2 never contains it (see :mod:`graphsplit.planning.opaque.sites`).
    traced arguments: the arguments of the call that are traced values, in pytree order: the
        node's ``args``. Everything else the function was called with (``self``, a pipeline
        object, ints, strings) is held by the :class:`OpaqueCall` as constants.
    opaque facts: what the example run found (:class:`OpaqueFacts`, ``node.meta["opaque"]``):
        the batch dim of each output tensor, the FLOPs, where the tensor value was read.

In: the function, its arguments with the traced values taken out. Out: a callable for fx:

    OpaqueCall(function, name, spec, constants, traced_positions)(*traced) -> the output
    is_opaque(node) -> bool
    probe_value(node, batch_size) -> the node's meta value at another batch size
    recheck_shapes(graph, stage2_nodes) -> None   # output sizes read as numbers: checked
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from graphsplit.errors import Fix, SplitError, user_error

# node.meta key of an opaque node's OpaqueFacts.
OPAQUE = "opaque"


@dataclass(frozen=True)
class OpaqueFacts:
    """What running an opaque call on the example batch found.

    ``batch_dims``: per output tensor (pytree order), the dim that holds one row per sample, or
    None for a tensor that is the same for every sample (or for a batch of one sample).
    ``label``: ``Class.method`` or ``module.function``; ``read_at``: the ``file:line  code`` that
    read a tensor value, the reason the call is opaque; ``reads``: see below.
    """

    batch_dims: tuple[int | None, ...]
    flops: int
    label: str
    read_at: str
    # The model's frozen parameters and buffers the run read (qualified names): stage 1 holds
    # them, so its weights fingerprint, device moves and meta check cover the opaque call.
    reads: tuple[str, ...] = ()


class OpaqueCall:
    """Call ``function`` with the constants it was traced with and the traced values given.

    fx names the generated global after ``__module__`` and ``__name__`` (the function's), so
    stage 1 reads ``encode_prompt = diffsynth_pipelines_wan_video_encode_prompt(ids, mask)``.
    ``planning`` is the example run while the step is traced (None afterwards).
    """

    def __init__(
        self,
        function: Callable[..., Any],
        name: str,
        spec: pytree.TreeSpec,
        constants: list[Any],
        traced_positions: tuple[int, ...],
    ) -> None:
        self.function = function
        self.__name__ = name
        self.__qualname__ = name
        self.__module__ = getattr(function, "__module__", None) or "opaque"
        self.spec = spec
        self.constants = constants
        self.traced_positions = traced_positions
        self.planning: Any = None
        # The output's structure (tuples, dicts) the graph was traced for: always checked.
        self.structure: pytree.TreeSpec | None = None
        # Set when stage-1 code after the call read one of its output sizes as a Python number
        # (see recheck_shapes): the shapes the plan was made for, None at the batch dim.
        self.shapes: tuple[tuple[int | None, ...], ...] | None = None

    def __call__(self, *traced: Any) -> Any:
        leaves = list(self.constants)
        for position, value in zip(self.traced_positions, traced, strict=True):
            leaves[position] = value
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        output = self.function(*args, **kwargs)
        if self.structure is not None and pytree.tree_structure(output) != self.structure:
            raise user_error(
                SplitError,
                f"{self.__name__} (run eagerly by stage 1: it reads tensor values) returned "
                f"{pytree.tree_structure(output)}, but this plan was made for its output "
                f"structure {self.structure}: the traced code after it reads its items by "
                "position.",
                fix=Fix(
                    "make the function return the same structure (one tensor per field, "
                    "not one per token or sample) for every batch, or split again"
                ),
            )
        if self.shapes is not None:
            self._check_shapes(output)
        return output

    def _check_shapes(self, output: Any) -> None:
        tensors = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
        for tensor, planned in zip(tensors, self.shapes, strict=False):
            shape = tuple(tensor.shape)
            if len(shape) != len(planned) or any(
                want is not None and want != got for want, got in zip(planned, shape)
            ):
                raise user_error(
                    SplitError,
                    f"{self.__name__} (run eagerly by stage 1: it reads tensor values) returned "
                    f"a tensor of shape {shape}, but this plan was made for "
                    f"{tuple('B' if size is None else size for size in planned)}: the step read "
                    "that size as a Python number after the call, so the plan holds for it only.",
                    fix=Fix(
                        "keep the output's size fixed (pad to a fixed length), or split "
                        "again for each size (bucket the dataset by size)"
                    ),
                )

    def __repr__(self) -> str:
        return f"<opaque call {self.__module__}.{self.__name__}>"

    def __deepcopy__(self, memo: dict[int, Any]) -> OpaqueCall:
        # Like a function target: a copied stage calls the same user objects, not copies of
        # the whole model the call's constants reach.
        return self


def is_opaque(node: fx.Node) -> bool:
    """Whether ``node`` is an opaque call (run eagerly by stage 1, never in stage 2)."""
    return node.op == "call_function" and isinstance(node.target, OpaqueCall)


def recheck_shapes(graph: fx.Graph, stage2: frozenset[fx.Node]) -> None:
    """Make each opaque call whose output sizes reached a guard outside stage 2 check them.

    A guard is a Python value the trace read (``range(x.shape[1])``) and baked into the plan.
    An opaque output's shape can change with the data (a prompt trimmed to its length); stage 2
    rechecks the sizes its own nodes read, stage 1 does not, so the call itself refuses another
    shape when any other node read one (its node may be in stage 1, or in neither stage: the
    int a ``range()`` consumed is no one's input). ``len`` of a container (a tuple of outputs,
    a ``.shape``) reads its structure or a rank, not a size: the structure is always checked.
    """
    guarded = {
        node
        for node in graph.nodes
        if node not in stage2
        and any(not _reads_a_container(guard, node) for guard in node.meta.get("guards", ()))
    }
    for node in graph.nodes:
        if not is_opaque(node) or not ({node} | _descendants(node)) & guarded:
            continue
        tensors = [leaf for leaf in pytree.tree_leaves(node.meta["val"]) if _is_tensor(leaf)]
        node.target.shapes = tuple(
            tuple(None if d == dim else size for d, size in enumerate(tensor.shape))
            for tensor, dim in zip(tensors, node.meta[OPAQUE].batch_dims, strict=True)
        )


def _reads_a_container(guard: Any, node: fx.Node) -> bool:
    return guard.convert is len and isinstance(node.meta.get("val"), (tuple, list, dict))


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def reachable(node: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """Every node reached from ``node`` by repeating ``step`` (``node`` itself excluded):
    ``lambda n: n.users`` gives what it feeds, ``lambda n: n.all_input_nodes`` what feeds it."""
    found: set[fx.Node] = set()
    pending = list(step(node))
    while pending:
        current = pending.pop()
        if current not in found:
            found.add(current)
            pending.extend(step(current))
    return found


def _descendants(node: fx.Node) -> set[fx.Node]:
    return reachable(node, lambda current: current.users)


def probe_value(node: fx.Node, batch_size: int) -> Any:
    """The opaque node's meta value with each per-sample output resized to ``batch_size``.

    The example run checked that each output holds one row per sample along its batch dim
    (running the call on the whole batch equals running it per sample and stacking), so at
    another batch size only that dim changes.
    """
    value = node.meta["val"]
    leaves, spec = pytree.tree_flatten(value)
    dims = iter(node.meta[OPAQUE].batch_dims)
    resized = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            dim = next(dims)
            if dim is not None and leaf.shape[dim] != batch_size:
                shape = list(leaf.shape)
                shape[dim] = batch_size
                leaf = torch.empty(shape, dtype=leaf.dtype, device="meta")
        resized.append(leaf)
    return pytree.tree_unflatten(resized, spec)
