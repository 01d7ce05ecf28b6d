"""Does a node mix the samples of its batch? Compare the ATen ops it ran at two batch sizes.

Glossary:
    mixes samples: the node combines samples of a batch (BatchNorm in train mode, a reduction
        over the batch, a select of one sample, a roll along it), so its value for one sample
        depends on which others share its batch; caching it per sample would be wrong.
    shape-only op: an ATen op whose output shape legitimately ignores its input's batch size
        (``sym_size``, ``new_zeros``); it says nothing about mixing.
    along-dim op: an op that moves or combines values along one dimension without changing its
        size (``roll``, ``cumsum``, ``softmax``, ``gather``); along the batch dim it mixes.

In: the :class:`~graphsplit.artifacts.AtenOp` records of one node at the two batch sizes.
Out: :func:`mixing_of` -> :class:`~graphsplit.artifacts.Mixing` or ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphsplit.artifacts import AtenOp, Mixing, MixingCause

# The name the op recorder gives batch_norm when it normalises with batch statistics.
BATCH_NORM_TRAINING = "batch_norm(training=True)"

# Ops whose output shape legitimately ignores their input's batch size.
SHAPE_ONLY_OPS = frozenset(
    {
        "sym_size",
        "sym_numel",
        "sym_stride",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty_strided",
        "_local_scalar_dense",
        "scalar_tensor",
    }
)

# Ops that move or combine values along a dimension without changing its size: along the batch
# dimension they make one sample's result depend on the others (or on its position).
ALONG_DIM_OPS = frozenset(
    {
        "roll",
        "flip",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "logcumsumexp",
        "sort",
        "argsort",
        "topk",
        "kthvalue",
        "softmax",
        "log_softmax",
        "index_select",
        "gather",
        "take_along_dim",
        "median",
        "mode",
        "scatter",
        "scatter_add",
        "index_add",
        "index_copy",
        "index_fill",
    }
)


def _moves_along_batch(shape_a: tuple, shape_b: tuple, dims: tuple[int, ...]) -> bool:
    """Whether ``dims`` name the dimension of the first input that follows the batch size."""
    if len(shape_a) != len(shape_b) or not dims:
        return False
    batch_dims = {d for d, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b}
    return any(int(dim) % max(len(shape_a), 1) in batch_dims for dim in dims)


def mixing_of(ops_a: Sequence[AtenOp], ops_b: Sequence[AtenOp]) -> Mixing | None:
    """The first op that combines samples: reduces/selects across, or moves along, the batch."""
    if len(ops_a) != len(ops_b) or any(a.name != b.name for a, b in zip(ops_a, ops_b)):
        return Mixing(MixingCause.DIFFERENT_OPS)
    for op_a, op_b in zip(ops_a, ops_b):
        if op_a.name == BATCH_NORM_TRAINING:
            return Mixing(MixingCause.BATCH_NORM_TRAINING)
        if op_a.name in SHAPE_ONLY_OPS or not op_a.output_shapes:
            continue
        if op_a.input_shapes != op_b.input_shapes and op_a.output_shapes == op_b.output_shapes:
            return Mixing(MixingCause.ACROSS_BATCH, op_a.name)
        if (
            op_a.input_shapes
            and op_b.input_shapes
            and _moves_along_batch(op_a.input_shapes[0], op_b.input_shapes[0], op_a.dims)
        ):
            return Mixing(MixingCause.ALONG_BATCH, op_a.name)
    return None
