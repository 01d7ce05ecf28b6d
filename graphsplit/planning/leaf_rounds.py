"""Trace and analyse in rounds: trace into mixed modules whose inputs are cacheable, repeat.

Glossary:
    round: one trace (:func:`~graphsplit.planning.tracing.tracer.trace_step`), codec insertion and
        analysis (:func:`~graphsplit.planning.analyse.node_facts.analyze`) with a given set of
        leaves.
    initial leaves: every submodule that holds parameters; modules are traced into only when
        that can move work out of the training step.
    trainable call: a call into a module that holds a trainable parameter; it runs in stage 2
        whatever it does, so the analysis does not record its ops.
    mixed module: a leaf whose parameters are part frozen, part trainable. Called as one node it
        is tainted, so its frozen half would run every step; when all its inputs are cacheable,
        the next round traces into it so the cut can separate the halves. If tracing into it
        fails (any error: library code may not be traceable) or the finer graph has no valid
        cut, the module stays whole and ``Traced.notes`` says why: a coarser split is never
        traded for an error.
    one sample per batch: a step given a batch-1 example that fails at the probe sizes (code
        that only runs at batch 1) is analysed again at batch 1
        (:func:`~graphsplit.planning.step.example_inputs.one_sample_examples`): a tensor computed
        from the data is the one sample's (cached per sample along a dim of size 1), a tensor that
        is not is a per-dataset constant, nothing can mix samples, and each batched input passes
        stage 1's run-time check
        (:func:`~graphsplit.planning.step.example_inputs.check_one_sample`).

In: the model, :class:`~graphsplit.artifacts.ExampleInputs`, the trainable parameter names.
Out: :class:`~graphsplit.artifacts.Traced` whose nodes carry ``meta["facts"]``:

    trace_and_analyze(model, examples, trainable) -> Traced
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import BatchLayout, ExampleInputs, TaintKind, Traced
from graphsplit.errors import SplitError, TensorValueError, TraceError, TrainableSideError
from graphsplit.planning.analyse.boundary_codecs import insert_codecs
from graphsplit.planning.analyse.node_facts import analyze, resolve_params
from graphsplit.planning.cut.boundary import (
    choose_boundary,
    compute_taint,
    facts,
    module_owner,
)
from graphsplit.planning.leaf_choice import (
    calls_worth_tracing,
    initial_leaves,
    leaves_to_trace_into,
    refuse_changed_leaf_calls,
    why_traced_into,
)
from graphsplit.planning.meta.analysis_view import analysis_view
from graphsplit.planning.meta.eager_protocols import inference_mode_as_no_grad_on_meta
from graphsplit.planning.opaque.example_run import ExampleRun
from graphsplit.planning.opaque.sites import (
    OpaqueSite,
    check_opaque_nodes,
    opaque_calls_recorded,
    read_in_step_body,
    site_of_failure,
)
from graphsplit.planning.opaque.value_reads import (
    answered_reads,
    check_value_reads,
    frozen_value_reads,
)
from graphsplit.planning.patching.autocast_queries import autocast_queries_answer_for_meta
from graphsplit.planning.patching.compiled_code import plan_compiled_code_as_written
from graphsplit.planning.patching.distribution_draws import meta_samplers_registered
from graphsplit.planning.patching.patcher import Patcher, cyclic_gc_paused
from graphsplit.planning.rules.grad_modes import check_grad_modes, deferred_calls_to_trace_into
from graphsplit.planning.rules.opaque_call import OPAQUE, is_opaque
from graphsplit.planning.rules.random_draws import (
    generator_states,
    refuse_own_draws,
    set_generator_states,
)
from graphsplit.planning.step.example_inputs import (
    ONE_SAMPLE,
    check_one_sample,
    example_batch_size,
    one_sample_examples,
)
from graphsplit.planning.tracing.tracer import trace_step

MAX_ROUNDS = 8
MAX_OPAQUE_SITES = 16


def trace_and_analyze(
    model: nn.Module, examples: ExampleInputs, trainable: frozenset[str]
) -> Traced:
    """Trace and analyse in rounds; a batch-1 step that needs it is planned one sample per batch.

    Given a batch-1 example, the step is planned one sample per batch when the probe sizes
    cannot plan it well: it fails there (code that runs only at batch 1), or frozen work looks
    like it mixes samples there (a loop over the batch, ``reshape(1, ...)``) and would run
    every step. If batch 1 fails too, that error is raised: it is the size the user gave.
    """
    states = generator_states()
    try:
        return refuse_own_draws(model, lambda: _trace_and_plan_batches(model, examples, trainable))
    except BaseException:
        # Whatever failed (a probe size, an example run, a retrace), the user's generators
        # are where they were: a refused split must not shift the step's later draws.
        set_generator_states(states)
        raise


def _trace_and_plan_batches(
    model: nn.Module, examples: ExampleInputs, trainable: frozenset[str]
) -> Traced:
    one_sample = example_batch_size(examples) == 1 and examples.batch_sizes != ONE_SAMPLE
    sites: list[OpaqueSite] = []  # found once, kept for every later trace
    answered: set[str] = set()  # value reads answered with the example's value (value_reads)
    try:
        traced = _rounds(model, examples, trainable, sites, answered)
    except Exception as at_probe_sizes:
        if not one_sample:
            raise
        first_line = (str(at_probe_sizes).strip().splitlines() or [""])[0]
        error = f"{type(at_probe_sizes).__name__}: {first_line}"
        why = f"fails at batch {examples.batch_sizes[0]} ({error})"
        return _one_sample_per_batch(model, examples, trainable, why, sites, answered)
    mixing = _frozen_work_judged_mixing(traced, trainable) if one_sample else []
    if not mixing:
        return traced
    why = (
        f"at batch {examples.batch_sizes[0]}, frozen {', '.join(mixing)} looked like mixing "
        "samples and would have run every step"
    )
    try:
        return _one_sample_per_batch(model, examples, trainable, why, sites, answered)
    except Exception:  # batch 1 is no better: keep the plan for every batch size
        return traced


def _one_sample_per_batch(
    model: nn.Module,
    examples: ExampleInputs,
    trainable: frozenset[str],
    why: str,
    sites: list[OpaqueSite],
    answered: set[str],
) -> Traced:
    sites[:] = [site for site in sites if site.trace_into]  # found again, each read named
    traced = _rounds(model, one_sample_examples(examples), trainable, sites, answered)
    note = (
        f"one sample per batch: the step {why}, so it was planned at batch 1: each batch is one "
        "sample, cached per sample, and stage 1 refuses a bigger batch (pass an example of 2 "
        "samples for a plan for every batch size)"
    )
    return replace(traced, notes=(*traced.notes, note), batch_sizes=ONE_SAMPLE)


def _frozen_work_judged_mixing(traced: Traced, trainable: frozenset[str]) -> list[str]:
    """Nodes doing real work (FLOPs) kept in stage 2 only because they looked like mixing."""
    taint = compute_taint(traced.graph, trainable)
    return [
        node.name
        for node, why in taint.items()
        if why.kind is TaintKind.MIXING and why.origin is node and facts(node).flops > 0
    ]


@contextlib.contextmanager
def _planning_switches(model: nn.Module) -> Iterator[None]:
    """The process-wide switches the analysis makes, through one patcher (undone on exit).

    Meta kernels for torch.distributions' samplers are registered
    (:func:`meta_samplers_registered`), the cyclic collector is paused (:func:`cyclic_gc_paused`),
    and torch's fake mode is kept from logging each op that fails on fake tensors (it logs a
    failing meta kernel with its traceback at ERROR level before it raises). The planning
    expects some failures (a step that runs only at batch 1 fails at the probe sizes; a module
    that cannot be traced into is kept whole), and one it does not expect reaches the user as a
    ``TraceError`` naming the op, the user's line and torch's message: noise either way.
    """
    with Patcher() as switches:
        switches.patch(logging.getLogger("torch._subclasses.fake_tensor"), "disabled", True)
        switches.enter_context(cyclic_gc_paused())
        switches.enter_context(meta_samplers_registered())
        autocast_queries_answer_for_meta(switches, _weights_device_type(model))
        inference_mode_as_no_grad_on_meta(switches)
        plan_compiled_code_as_written(switches, model)  # unet._orig_mod, not dynamo
        yield


def _rounds(
    model: nn.Module,
    examples: ExampleInputs,
    trainable: frozenset[str],
    sites: list[OpaqueSite],
    answered: set[str],
) -> Traced:
    """Trace, analyse, and trace into mixed modules whose inputs are all cacheable and leaves
    called under a state the step changed (:mod:`..rules.leaf_state`); repeat (under
    :func:`_planning_switches`)."""
    with _planning_switches(model):
        param_names = {id(param): name for name, param in model.named_parameters()}
        leaves = initial_leaves(model)
        notes: list[str] = []
        kept_whole: frozenset[str] = frozenset()
        traced = _trace_once(model, examples, param_names, leaves, trainable, sites, answered)
        for _ in range(MAX_ROUNDS):
            deferred = deferred_calls_to_trace_into(
                traced.graph, trainable, leaves, param_names.values()
            )
            changed = leaves_to_trace_into(traced.graph, leaves)  # the step changed them
            taint = compute_taint(traced.graph, trainable)
            mixed, counted = calls_worth_tracing(traced, trainable, taint, model)
            expand = (mixed | deferred | changed | counted) & leaves
            if not expand:
                break
            try:
                finer = _trace_once(
                    model, examples, param_names, leaves - expand, trainable, sites, answered
                )
            except Exception as exc:  # any failure inside library code: keep the module whole
                notes.append(f"kept {', '.join(sorted(expand))} whole: {_why(exc)}")
                kept_whole = expand
                break
            try:
                choose_boundary(finer.graph, trainable)  # a finer trace must still have a cut
            except Exception as exc:
                notes.append(f"kept {', '.join(sorted(expand))} whole: {_why(exc, cut=True)}")
                kept_whole = expand
                break
            traced, leaves = finer, leaves - expand
            why = why_traced_into(expand, changed, counted)
            notes.append(f"traced into {', '.join(sorted(expand))}: {why}")
        check_grad_modes(traced.graph, trainable)  # the calls no round could trace into
        refuse_changed_leaf_calls(traced.graph)
        return replace(traced, notes=traced.notes + tuple(notes), kept_whole=kept_whole)


def _weights_device_type(model: nn.Module) -> str:
    """The device type of the step's first real (not meta) weight; "cpu" if it has none."""
    tensors = (*model.parameters(), *model.buffers())
    return next((t.device.type for t in tensors if t.device.type != "meta"), "cpu")


def _why(exc: Exception, *, cut: bool = False) -> str:
    """One line for the report: why tracing into a module was given up (``cut``: the finer
    trace ran, but has no valid cut)."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    if cut:
        return f"split inside it has no valid cut ({first_line})"
    kind = "" if isinstance(exc, (TraceError, SplitError)) else f"{type(exc).__name__}: "
    return f"tracing into it failed ({kind}{first_line})"


def _trace_once(
    model: nn.Module,
    examples: ExampleInputs,
    param_names: dict[int, str],
    leaves: frozenset[str],
    trainable: frozenset[str],
    sites: list[OpaqueSite],
    answered: set[str],
) -> Traced:
    is_trainable_call = _trainable_calls(model, trainable)

    def reads_trainable(node: fx.Node) -> bool:
        return is_trainable_call(node) or (node.op == "get_attr" and node.target in trainable)

    run = ExampleRun(model, examples, trainable, reads_trainable)  # real weights: before the view
    with analysis_view(model):

        def recorded(node: fx.Node) -> bool:
            return not is_trainable_call(node)

        traced = _trace_with_opaque_calls(model, examples, leaves, recorded, run, sites, answered)
        insert_codecs(traced.graph)
        if examples.batch_sizes == ONE_SAMPLE:
            _check_one_sample_inputs(traced.graph, examples)
        calls = frozenset(n for n in traced.graph.nodes if is_trainable_call(n))
        analyze(traced, model, examples, trainable_calls=calls)
    if examples.batch_sizes == ONE_SAMPLE:
        _one_sample_facts(traced.graph)
    resolve_params(traced, model, param_names)
    check_grad_modes(traced.graph, trainable, defer_mixed_calls=True)  # refused after rounds
    check_opaque_nodes(traced.graph, trainable)
    check_value_reads(traced.graph, trainable, several_samples=examples.batch_sizes != ONE_SAMPLE)
    notes = _opaque_notes(traced.graph) + _value_read_notes(traced.graph)
    return replace(traced, notes=traced.notes + notes)


def _trace_with_opaque_calls(
    model: nn.Module,
    examples: ExampleInputs,
    leaves: frozenset[str],
    recorded: Callable[[fx.Node], bool],
    run: ExampleRun,
    sites: list[OpaqueSite],
    answered: set[str],
) -> Traced:
    """Trace; where frozen code reads a tensor value, record its function as one opaque node
    and trace again (:mod:`graphsplit.planning.opaque.sites`), outward until the trace succeeds.

    When no function around a read can be opaque (none is patchable, or the example run
    refuses the one found: it runs the trainable DiT too), a step planned one sample per batch
    has the read itself answered (unless it is in the step's own code, which the user can write
    with tensor ops) with the example's value, checked in stage 1
    (:mod:`graphsplit.planning.opaque.value_reads`); ``answered`` lists those reads' lines. The
    sites tried for that read (``chain``) are dropped. An answered read whose tensor turns out to
    depend on a trainable parameter or a random draw is refused there, naming the line.
    """
    read: str | None = None  # the user's line whose value read the newest sites are for
    tentative: dict[str, Exception] = {}  # per read answered at batch > 1: the error before
    in_body = False  # whether that line is in the step's own code (never answered)
    chain: list[OpaqueSite] = []
    while True:
        traced_into = {site.leaf for site in sites if site.leaf is not None}
        try:
            with opaque_calls_recorded(sites, run), frozen_value_reads(run, frozenset(answered)):
                traced = trace_step(
                    model, examples.values[0], leaves - traced_into, record=recorded
                )
            break
        except TensorValueError as exc:
            if exc.read_at is not None:
                if exc.read_at in answered:
                    # Answered, and refused: its tensor is not frozen data. At several samples
                    # per batch, the refusal the read met before answering is the one to show
                    # (it names the function and why); a value not every sample shares adds
                    # the bucketing fix as a note.
                    before = tentative.get(exc.read_at)
                    if before is None:
                        raise
                    if getattr(exc, "not_shared", False):
                        before.add_note(str(exc))
                    raise before from None
                read, chain = exc.read_at, []
                in_body = read_in_step_body(exc)
            site = site_of_failure(exc, sites, model, run.trainable)
            if site is not None and len(sites) < MAX_OPAQUE_SITES:
                sites.append(site)
                chain.append(site)
                continue
            ending: Exception = exc
        except TrainableSideError as exc:  # the function runs the trainable model too
            if not chain:
                # A site kept from an earlier trace (at the probe sizes, its example run was
                # refused for the batch size alone): drop it; the read is found again.
                kept = [site for site in sites if site is exc.site]
                if not kept:
                    raise
                sites.remove(kept[0])
                continue
            ending = exc
        # No function around the read can be one opaque step: drop those tried for it.
        sites[:] = [site for site in sites if not any(site is tried for tried in chain)]
        chain = []
        if read is None or in_body or not _answerable(examples):
            raise ending
        if examples.batch_sizes != ONE_SAMPLE:
            tentative[read] = ending
        answered.add(read)  # and trace again, the read answered (planning/opaque/value_reads.py)
        read = None
    for node in traced.graph.nodes:
        if is_opaque(node):
            node.target.planning = None  # the example batch and real values are not kept
    return traced


def _answerable(examples: ExampleInputs) -> bool:
    """Whether value reads may be answered: planned one sample per batch, or from an example of
    several samples (the probe trace is at the example's size, so the value read is the
    trace's; only a per-sample value every sample shares is answered there,
    ``value_reads._refuse_a_batch_value``). A one-sample example at the probe sizes is not:
    its value is one sample's, the trace is of several; it is planned one sample per batch."""
    return examples.batch_sizes == ONE_SAMPLE or example_batch_size(examples) > 1


def _opaque_notes(graph: fx.Graph) -> tuple[str, ...]:
    return tuple(
        f"{node.name}: {node.meta[OPAQUE].label} runs eagerly in stage 1 (it reads tensor "
        f"values at {node.meta[OPAQUE].read_at}); stage 2 never runs it"
        for node in graph.nodes
        if is_opaque(node)
    )


def _value_read_notes(graph: fx.Graph) -> tuple[str, ...]:
    return tuple(
        f"the value read at {read.read_at} is this plan's: {read.value!r} (it was read from "
        "frozen data on the example batch); stage 1 checks it on every batch and refuses "
        "another value"
        for read in answered_reads(graph)
    )


def _check_one_sample_inputs(graph: fx.Graph, examples: ExampleInputs) -> None:
    """Route each batched input through :func:`check_one_sample`, under the input's own name.

    The placeholder is renamed ``<name>_batch`` and the check takes its name, so a cached raw
    input keeps its key and the generated code reads ``x = check_one_sample(x_batch, 'x')``.
    """
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        value = examples.inputs.get(node.target)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != 1:
            continue
        name = node.name
        node._rename(f"{name}_batch")
        with graph.inserting_after(_last_placeholder(graph)):
            check = graph.call_function(check_one_sample, (node, node.target))
        node.replace_all_uses_with(check, delete_user_cb=lambda user, c=check: user is not c)
        # fx never frees a name; without this the check would be ``x_1`` (a worse cache key).
        getattr(graph._graph_namespace, "_used_names", set()).discard(name)
        check._rename(name)
        check.meta = {key: value for key, value in node.meta.items() if key != "facts"}


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


def _one_sample_facts(graph: fx.Graph) -> None:
    """Facts of a batch-1 analysis: what was computed from the data is the one sample's.

    Both probe runs were at batch 1, so the analysis saw every tensor as constant and every
    data tensor as mixing the batch. With one sample per batch nothing can mix samples; a
    data tensor is cached per sample along its first dim of size 1 (any such dim splits and
    restacks exactly at batch 1), and one with no such dim is left uncacheable. Ints are not
    batch sizes: at batch 1 every ``1`` would look like one.
    """
    for node in graph.nodes:
        old = node.meta.get("facts")
        if old is None:
            continue
        new = replace(old, mixing=None, is_batch_size=False)
        if old.is_tensor and old.depends_on_data:
            dim = next((d for d, size in enumerate(old.shape) if size == 1), None)
            layout = BatchLayout.UNKNOWN if dim is None else BatchLayout.PER_SAMPLE
            new = replace(
                new,
                batch_layout=layout,
                batch_dim=dim,
                bytes_per_sample=0 if dim is None else old.total_bytes,
            )
        node.meta["facts"] = new


def _trainable_calls(model: nn.Module, trainable: frozenset[str]) -> Callable[[fx.Node], bool]:
    """Whether a node is a call into a module that holds a trainable parameter (it runs in
    stage 2 regardless), answered once per module path.

    Asked for every node twice (while traced, and of the traced graph); a path names one
    module for the whole plan (stage code calls it by that path), so its answer is kept:
    walking a module's parameters per node was a cost of its own on long chains.
    """
    known: dict[str, bool] = {}

    def is_trainable_call(node: fx.Node) -> bool:
        owner = module_owner(node)
        if owner is None:
            return False
        path = owner.target
        answer = known.get(path)
        if answer is None:
            module = model.get_submodule(path)
            answer = any(name in trainable for name, _ in module.named_parameters(prefix=path))
            known[path] = answer
        return answer

    return is_trainable_call
