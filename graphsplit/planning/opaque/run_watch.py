"""The watch around an example run: what the run reads of the model, and what it may not do.

An opaque call (:mod:`graphsplit.planning.opaque.example_run`) runs for real on the example
batch with the model's frozen weights put back; :class:`WatchedRun`, a torch function mode,
sees every torch call of that run.

Glossary:
    read: a frozen tensor of the model the run passed to a torch call (``OpaqueFacts.reads``:
        the cache is stale when one of them changes).
    refusal: a tensor on ``meta`` reached by the run: a trainable parameter (kept on meta for
        the run, so it is never read: a :class:`~graphsplit.errors.TrainableSideError` naming
        the site) or a frozen weight or input that has no real value
        (:class:`~graphsplit.errors.OpaqueCallError`).
    write: a model tensor whose version or bytes changed during the run (a BatchNorm in train
        mode); buffers are put back as they were and the example run refuses the call.

In: the model's tensors by id and their names, the trainable names, the node and its site.
Out:

    with WatchedRun(names, trainable, node, site, real_names, read) as watch: ...
    watch.undo_writes() -> names written (buffers restored)
    naming_site(site, error) -> error           # a TrainableSideError with its site set
    same_bytes(a, b) -> bool                     # bit-for-bit equality, NaN equal to NaN
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from graphsplit.errors import (
    Fix,
    GraphsplitError,
    OpaqueCallError,
    TrainableSideError,
    user_error,
)
from graphsplit.planning.opaque.site_types import VALUE_FIX, OpaqueSite, ValueSite

__all__ = ["WatchedRun", "naming_site", "same_bytes"]


def naming_site(site: OpaqueSite | ValueSite, error: GraphsplitError) -> GraphsplitError:
    """``error`` (a :class:`TrainableSideError`: the call belongs to the trainable side), with
    the refused call's site as a typed field, which the planning reads to answer the read."""
    assert isinstance(error, TrainableSideError)
    error.site = site
    return error


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equals NaN): the tensors' bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


class WatchedRun(TorchFunctionMode):
    """The example run's torch calls: the model's frozen tensors each reads are noted in
    ``read``; the first on a meta tensor is refused: a trainable parameter (kept on meta for
    the run, so it is never read) or a frozen weight or input that has no real value."""

    def __init__(
        self,
        names: Mapping[int, str],
        trainable: frozenset[str],
        node: fx.Node,
        site: OpaqueSite | ValueSite,
        real_names: Mapping[int, str],
        read: set[str],
    ) -> None:
        super().__init__()
        self.names, self.trainable, self.node, self.site = names, trainable, node, site
        self.real_names, self.read = real_names, read
        # Each model tensor the run touched: its version then, and a copy of a buffer's value
        # (running statistics, caches: small) so that a write can be undone.
        self.before: dict[int, tuple[torch.Tensor, int, torch.Tensor | None]] = {}
        # A call this one calls, refused for mixing samples (why this caller is being tried).
        self.callee: GraphsplitError | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if not isinstance(leaf, torch.Tensor):
                continue
            if leaf.is_meta:
                raise self._error(self.names.get(id(leaf)))
            name = self.real_names.get(id(leaf))
            if name is not None:
                self.read.add(name)
                if id(leaf) not in self.before:
                    copy = None if isinstance(leaf, nn.Parameter) else leaf.detach().clone()
                    self.before[id(leaf)] = (leaf, leaf._version, copy)
        return func(*args, **kwargs)

    def undo_writes(self) -> list[str]:
        """Names of the model's tensors the run wrote into; buffers are put back as they were."""
        written = []
        for tensor, version, copy in self.before.values():
            # Kernels may write without bumping the version (BatchNorm's running statistics are
            # not marked as written in its schema), so a buffer's bytes are compared too.
            if tensor._version != version or (copy is not None and not same_bytes(tensor, copy)):
                written.append(self.real_names[id(tensor)])
                if copy is not None:
                    with torch.no_grad():
                        tensor.copy_(copy)
        return sorted(written)

    def _error(self, name: str | None) -> GraphsplitError:
        label = self.site.label
        if name in self.trainable:
            reason = (
                f"{label} reads tensor values and reads the trainable parameter {name}: "
                "value-dependent code runs eagerly in stage 1, and is never allowed on the "
                "trainable side."
            )
            callee = self.callee  # the caller was tried because the callee mixes samples
            if callee is not None:
                reason = f"{reason} It was tried as the caller of: {callee.reason}"
            return naming_site(
                self.site,
                user_error(
                    TrainableSideError,
                    reason,
                    node=self.node,
                    source=self.site.read_at,
                    fix=callee.fix if callee is not None and callee.fix else VALUE_FIX,
                ),
            )
        what = f"the frozen tensor {name}" if name else "a tensor"
        return user_error(
            OpaqueCallError,
            f"{label} reads tensor values, so graphsplit runs it once on the example batch to "
            f"learn its output's shapes, and that needs real weights and data; {what} is on "
            "the meta device.",
            node=self.node,
            source=self.site.read_at,
            fix=Fix(
                "load the frozen weights this function uses (and pass a real example batch) "
                "for split(); stage 2's process may still build them on meta"
            ),
        )
