"""The example run: an opaque call, run for real on the example batch while the step is traced.

Glossary (see :mod:`graphsplit.planning.opaque.sites` for how the calls are found and recorded):
    example run: the opaque call runs on the example batch, its inputs computed for real by the
        graph traced so far, the model's real frozen weights put back for the run (the analysis
        otherwise sees meta twins; trainable ones stay on meta, so the run cannot read them).
        Its output's shapes and dtypes become the node's meta value, its FLOPs the node's work
        (``FlopCounterMode``'s count of the torch ops it ran; 0 when none it has a formula for
        ran, which the report shows as not counted: Python work on tensor values is not seen).
    refusals: inputs that depend on a trainable parameter or a random draw; a trainable
        parameter, a frozen weight or an input on ``meta`` read by the run; random numbers
        drawn (the user's generators are restored either way); writes into the call's inputs
        or into the model's own tensors (a BatchNorm in train mode: undone, then refused);
        outputs that are not tensors (a ``TensorValueError``: the caller is tried).
    per-sample check: with a batch of several samples, the call also runs on each sample
        alone; each output must equal the samples' outputs stacked along one dim (its batch
        dim; integers bit for bit, floats up to the last bits a batched kernel moves, as the
        module-level path allows), or be the same for every sample; otherwise it mixes samples (a
        ``TensorValueError``: the caller is tried, and the last one tried is refused with the
        advice to plan at batch 1).

What each run reads of the model, and the refusals of meta tensors and writes, are seen by the
watch of :mod:`graphsplit.planning.opaque.run_watch`.

In: the model (real weights, captured before its analysis view), the example batch, the
trainable names. Out: ``node.meta["val"]``, ``node.meta["opaque"]`` and the op record of each
opaque node, through the tracer's interpreter:

    ExampleRun(model, examples, trainable, is_trainable_node).example_value(node) -> meta value
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop

from graphsplit.artifacts import ExampleInputs, OpRecord
from graphsplit.batch_invariance import rows_alike
from graphsplit.errors import (
    Fix,
    GraphsplitError,
    OpaqueCallError,
    TensorValueError,
    TrainableSideError,
    user_error,
)
from graphsplit.planning.meta.analysis_view import to_meta
from graphsplit.planning.meta.meta_interpreter import fetch
from graphsplit.planning.meta.op_recorder import OP_RECORD
from graphsplit.planning.opaque.run_watch import WatchedRun, naming_site
from graphsplit.planning.opaque.site_types import VALUE_FIX, OpaqueSite, ValueSite
from graphsplit.planning.patching.torch_calls import RANDOM_FILLS, RANDOM_FUNCTIONS
from graphsplit.planning.rules.opaque_call import OPAQUE, OpaqueCall, OpaqueFacts, reachable
from graphsplit.planning.rules.random_draws import (
    changed_generators,
    generator_states,
    set_generator_states,
)
from graphsplit.planning.rules.user_lines import describe
from graphsplit.planning.step.example_inputs import example_batch_size
from graphsplit.runtime import functional_inplace

_ATEN = torch.ops.aten
# FLOP formulas FlopCounterMode lacks: on the CPU, scaled_dot_product_attention runs this kernel
# (on meta the analysis counts the math it decomposes into; the formula gives the same count).
# ``sdpa_flop`` is registered wrapped to take shapes; FlopCounterMode wraps a mapping itself.
_MISSING_FORMULAS = {_ATEN._scaled_dot_product_flash_attention_for_cpu: sdpa_flop.__wrapped__}


@dataclass
class ExampleRun:
    """Runs opaque calls for real on the example batch while the step is traced.

    ``is_trainable_node(node)``: a call into a module holding trainable parameters, or a read
    of one. Real frozen tensors are captured on creation, before the model enters its analysis
    view (where every parameter is a meta twin).
    """

    model: nn.Module
    examples: ExampleInputs
    trainable: frozenset[str]
    is_trainable_node: Callable[[fx.Node], bool]
    real: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # Real values of traced nodes, per run: None (the whole batch) or a sample's index.
    values: dict[int | None, dict[fx.Node, Any]] = field(default_factory=dict)
    sites: dict[int, OpaqueSite] = field(default_factory=dict)
    # Qualified name of each real frozen tensor, and those each opaque node's run read.
    real_names: dict[int, str] = field(default_factory=dict)
    reads: dict[fx.Node, set[str]] = field(default_factory=dict)
    # The last call refused for mixing samples: its caller is tried next, and a refusal of the
    # caller for reading a trainable parameter names it (the cause the user can act on).
    mixing_callee: TensorValueError | None = None

    def __post_init__(self) -> None:
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            dotted = f"{prefix}." if prefix else ""
            for name, tensor in module._parameters.items():
                frozen = dotted + name not in self.trainable
                if tensor is not None and not tensor.is_meta and frozen:
                    self.real[(id(module), "p" + name)] = tensor
                    self.real_names.setdefault(id(tensor), dotted + name)
            for name, tensor in module._buffers.items():
                if tensor is not None and not tensor.is_meta:
                    self.real[(id(module), "b" + name)] = tensor
                    self.real_names.setdefault(id(tensor), dotted + name)

    def record(
        self, site: OpaqueSite, function: Callable[..., Any], tracer: Any, args: tuple, kwargs: dict
    ) -> Any:
        """One node for this call; its value comes from :meth:`example_value`."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Proxy))
        constants = [None if i in positions else leaf for i, leaf in enumerate(leaves)]
        call = OpaqueCall(function, self._name(site, args), spec, constants, positions)
        call.planning = self
        self.sites[id(call)] = site
        return tracer.create_proxy("call_function", call, tuple(leaves[i] for i in positions), {})

    def _name(self, site: OpaqueSite, args: tuple) -> str:
        """``encode_prompt``; for a module's method, the module's name: ``encoder``,
        ``vae_encode``."""
        if site.leaf is None or not args or not isinstance(args[0], nn.Module):
            return site.attribute
        name = next((n for n, m in self.model.named_modules() if m is args[0]), None)
        if not name:
            return site.attribute
        name = name.replace(".", "_")
        return name if site.attribute == "forward" else f"{name}_{site.attribute}"

    def example_value(self, node: fx.Node) -> Any:
        """Run the call on the example batch (and per sample); its meta value and facts."""
        site = self.sites[id(node.target)]
        self._refuse_tainted_inputs(node, site)
        self._refuse_probe_sizes(node, site)
        flops = FlopCounterMode(display=False, custom_mapping=_MISSING_FORMULAS)
        full = self._value(node, None, site, flops)
        # None (a field the call left empty) carries no data: the structure check keeps it.
        outputs = [leaf for leaf in pytree.tree_leaves(full) if leaf is not None]
        if not all(isinstance(leaf, torch.Tensor) for leaf in outputs):
            kinds = sorted({type(leaf).__name__ for leaf in outputs})
            raise user_error(
                TensorValueError,
                f"{site.label} reads tensor values and returns {', '.join(kinds)}: a Python "
                "value read from the data would be frozen into the plan, so its caller is "
                "run eagerly instead.",
                node=node,
                source=site.read_at,
                fix=VALUE_FIX,
            )
        dims = self._batch_dims(node, site, outputs)
        reads = tuple(sorted(self.reads.get(node, ())))
        total = flops.get_total_flops()
        node.meta[OPAQUE] = OpaqueFacts(dims, total, site.label, site.read_at, reads)
        node.target.structure = pytree.tree_structure(full)
        # FLOPs > 0 makes it frozen work the cut never moves to stage 2 (taint.is_banned).
        node.meta[OP_RECORD] = OpRecord((), max(total, 1))
        return to_meta(full)

    # -- refusals before anything runs ------------------------------------------------------
    def tainting_ancestor(self, nodes: set[fx.Node]) -> tuple[fx.Node, str] | None:
        """The first of ``nodes`` that reads a trainable parameter or draws random numbers,
        and which of the two (in words); None when every one is frozen work on data."""
        for ancestor in nodes:
            if self.is_trainable_node(ancestor):
                return ancestor, "a trainable parameter"
            if _draws_random(ancestor):
                return ancestor, "a random draw"
        return None

    @staticmethod
    def computed_from(node: fx.Node) -> set[fx.Node]:
        """``node`` and every node it is computed from."""
        return _ancestors(node) | {node}

    def real_value(self, node: fx.Node, site: ValueSite) -> Any:
        """``node``'s real value on the example batch, computed by the graph traced so far
        (the caller has refused a tainted ``node``: see :meth:`tainting_ancestor`)."""
        values = self.values.setdefault(None, {})
        if node not in values:
            needed = self.computed_from(node)
            pending = [n for n in node.graph.nodes if n in needed and n not in values]
            with self._real_run(node, site):
                for current in pending:
                    values[current] = self._run_node(current, values, None)
        return values[node]

    def _refuse_tainted_inputs(self, node: fx.Node, site: OpaqueSite) -> None:
        tainting = self.tainting_ancestor(_ancestors(node))
        if tainting is not None:
            ancestor, why = tainting
            raise naming_site(
                site,
                user_error(
                    TrainableSideError,
                    f"{site.label} reads tensor values, and its inputs depend on {why} "
                    f"({ancestor.name}, {describe((ancestor.meta.get('source', '?'), ''))}). "
                    "Value-dependent code can run eagerly in stage 1 only when every input is "
                    "frozen and free of random draws; it is never allowed on the trainable side.",
                    node=node,
                    source=site.read_at,
                    fix=Fix(f"{VALUE_FIX.words}, or compute {site.label}'s inputs without {why}"),
                ),
            )

    def _refuse_probe_sizes(self, node: fx.Node, site: OpaqueSite) -> None:
        traced, example = self.examples.batch_sizes[0], example_batch_size(self.examples)
        if traced != example:
            raise user_error(
                OpaqueCallError,
                f"{site.label} reads tensor values and runs eagerly on the example batch, which "
                f"holds {example} sample(s), but the step is traced at batch {traced}.",
                node=node,
                source=site.read_at,
                fix=Fix(
                    "pass an example batch of one sample (planned one sample per batch) or of "
                    "two or more samples"
                ),
            )

    # -- running for real -------------------------------------------------------------------
    def _value(
        self,
        node: fx.Node,
        sample: int | None,
        site: OpaqueSite,
        flops: FlopCounterMode | None = None,
    ) -> Any:
        """``node``'s real value on the batch (``sample`` None) or on one sample; ``flops``
        counts the call's own work (not that of the inputs computed for it)."""
        values = self.values.setdefault(sample, {})
        if node in values:
            return values[node]
        ancestors = _ancestors(node)
        pending = [n for n in node.graph.nodes if n in ancestors and n not in values]
        with self._real_run(node, site):
            for ancestor in pending:
                values[ancestor] = self._run_node(ancestor, values, sample)
            inputs = [values[arg] for arg in node.args]
            versions = [_version(value) for value in inputs]
            with flops if flops is not None else contextlib.nullcontext():
                values[node] = node.target(*inputs)
        if versions != [_version(value) for value in inputs]:
            raise user_error(
                OpaqueCallError,
                f"{site.label} reads tensor values and writes into its own inputs in place, so "
                "running it once in stage 1 would not leave the inputs as the step leaves them.",
                node=node,
                source=site.read_at,
                fix=Fix("write into a copy (x = x.clone()) inside the function"),
            )
        return values[node]

    def _run_node(self, node: fx.Node, values: dict[fx.Node, Any], sample: int | None) -> Any:
        if node.op == "placeholder":
            return self._input(node.target, sample)
        if node.op == "get_attr":
            return fetch(self.model, {}, node.target)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        if node.op == "call_module":
            return self.model.get_submodule(node.target)(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    def _input(self, name: str, sample: int | None) -> Any:
        value = self.examples.inputs.get(name)
        if sample is None or not _is_batched(value, example_batch_size(self.examples)):
            return value
        return value[sample : sample + 1]

    @contextlib.contextmanager
    def _real_run(self, node: fx.Node, site: OpaqueSite | ValueSite) -> Iterator[None]:
        """Real frozen weights in place, no autograd, meta tensors and RNG draws refused."""
        # Every alias of a tied tensor, named as named_parameters() names it (its first path):
        # DistilBERT's vocab_projector.weight is the trainable word embedding, not a frozen one.
        names: dict[int, str] = {}
        for name, tensor in (
            *self.model.named_parameters(remove_duplicate=False),
            *self.model.named_buffers(remove_duplicate=False),
        ):
            names.setdefault(id(tensor), name)
        states = generator_states()
        swapped = self._swap_in_real()
        try:
            read = self.reads.setdefault(node, set())
            watch = WatchedRun(names, self.trainable, node, site, self.real_names, read)
            watch.callee = self.mixing_callee
            with torch.no_grad(), watch:
                yield
        finally:
            written = watch.undo_writes()
            for table, name, twin in swapped:
                table[name] = twin
            changed = changed_generators(states, generator_states())
            set_generator_states(states)
        if written:
            raise user_error(
                OpaqueCallError,
                f"{site.label} reads tensor values, so it would run eagerly in stage 1, but it "
                f"writes into the model's {', '.join(written)} (a BatchNorm in train mode "
                "updates its running statistics): cached, the step would change the model once "
                "per sample instead of every step. graphsplit undid the write.",
                node=node,
                source=site.read_at,
                fix=Fix(
                    "put the frozen module in eval mode (module.eval(), as from_pretrained "
                    "returns it), or move the write out of the function"
                ),
            )
        if changed:
            raise naming_site(
                site,
                user_error(
                    TrainableSideError,
                    f"{site.label} reads tensor values, so it would run eagerly in stage 1, but "
                    f"it draws random numbers ({', '.join(changed)} generator): the draw would be "
                    "frozen into the cache instead of happening every step.",
                    node=node,
                    source=site.read_at,
                    fix=Fix(
                        "draw the random numbers outside this function, after the frozen work, "
                        "with torch (torch.randn_like, torch.randint, ...)"
                    ),
                ),
            )

    def _swap_in_real(self) -> list[tuple[dict[str, Any], str, Any]]:
        swapped = []
        for module in self.model.modules():
            for kind, table in (("p", module._parameters), ("b", module._buffers)):
                for name, tensor in table.items():
                    real = self.real.get((id(module), kind + name))
                    if real is not None and tensor is not real:
                        swapped.append((table, name, tensor))
                        table[name] = real
        return swapped

    # -- the per-sample check ---------------------------------------------------------------
    def _batch_dims(
        self, node: fx.Node, site: OpaqueSite, outputs: list[torch.Tensor]
    ) -> tuple[int | None, ...]:
        batch = example_batch_size(self.examples)
        if batch == 1:
            return tuple(None for _ in outputs)
        whole_structure = pytree.tree_structure(self._value(node, None, site))
        per_sample = []
        for sample in range(batch):
            try:
                value = self._value(node, sample, site)
            except GraphsplitError:
                raise
            except Exception as exc:  # packed inputs (Qwen2-VL's patches) cut by another input
                first = (str(exc).strip().splitlines() or [""])[0]
                raise self._mixes(
                    node, site, f"it fails on one sample alone ({type(exc).__name__}: {first})"
                ) from exc
            if pytree.tree_structure(value) != whole_structure:  # one item per sample, say
                raise self._mixes(node, site, "its output is not structured as each sample's own")
            per_sample.append([leaf for leaf in pytree.tree_leaves(value) if leaf is not None])
        dims = []
        for index, whole in enumerate(outputs):
            dim = _stacking_dim(whole, [leaves[index] for leaves in per_sample])
            if dim is _MIXES:
                shape = tuple(whole.shape)
                raise self._mixes(
                    node, site, f"its output {index} {shape} is not the samples' own stacked"
                )
            dims.append(dim)
        return tuple(dims)

    def _mixes(self, node: fx.Node, site: OpaqueSite, what: str) -> TensorValueError:
        """A TensorValueError: the caller is tried next, it may restack per sample."""
        batch = example_batch_size(self.examples)
        self.mixing_callee = user_error(
            TensorValueError,
            f"{site.label} reads tensor values and mixes the samples of a batch: run on the "
            f"whole example batch of {batch}, {what} (it pads to the batch's longest item, "
            "returns one item per sample, or reads across samples), so one sample's cached "
            "value would depend on the samples batched with it.",
            node=node,
            source=site.read_at,
            fix=Fix(
                "plan at batch 1: pass an example batch of one sample (graphsplit then plans "
                "one sample per batch, as DiffSynth trains), or pad to a fixed length"
            ),
        )
        return self.mixing_callee


_MIXES = object()


def _stacking_dim(whole: torch.Tensor, samples: list[torch.Tensor]) -> Any:
    """The dim along which ``samples`` stack into ``whole`` (floating values up to the last
    bits a batched kernel moves: :mod:`graphsplit.batch_invariance`); None when every sample's
    output is ``whole`` itself; ``_MIXES`` otherwise."""
    batch = len(samples)
    for dim in range(whole.dim()):
        row = (*whole.shape[:dim], 1, *whole.shape[dim + 1 :])
        if whole.shape[dim] != batch or any(tuple(sample.shape) != row for sample in samples):
            continue
        stacked = torch.cat(samples, dim=dim)
        if rows_alike(stacked, whole):
            return dim
    if all(rows_alike(sample, whole) for sample in samples):
        return None
    return _MIXES


def _is_batched(value: Any, batch: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] == batch
    return type(value) in (list, tuple) and len(value) == batch


def _version(value: Any) -> int | None:
    if not isinstance(value, torch.Tensor) or value.is_inference():  # inference: no counter
        return None
    return value._version


def _ancestors(node: fx.Node) -> set[fx.Node]:
    return reachable(node, lambda current: current.all_input_nodes)


def _draws_random(node: fx.Node) -> bool:
    record = node.meta.get(OP_RECORD)
    if record is not None and any(op.draws_random for op in record.ops):
        return True
    if node.op != "call_function":
        return False
    if node.target in RANDOM_FUNCTIONS:
        return True
    return node.target is functional_inplace and any(
        fill.__name__ == node.args[1] for fill in RANDOM_FILLS
    )
