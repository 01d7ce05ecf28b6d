"""Trace and analyse in rounds: trace into mixed modules whose inputs are cacheable, repeat.

Glossary:
    round: one trace (:func:`~graphsplit.planning.trace.trace_step`), codec insertion and
        analysis (:func:`~graphsplit.planning.analyze.analyze`) with a given set of leaves.
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

In: the model, :class:`~graphsplit.artifacts.ExampleInputs`, the trainable parameter names.
Out: :class:`~graphsplit.artifacts.Traced` whose nodes carry ``meta["facts"]``:

    trace_and_analyze(model, examples, trainable) -> Traced
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import replace

import torch.fx as fx
from torch import nn

from graphsplit.artifacts import ExampleInputs, Traced
from graphsplit.errors import SplitError, TraceError
from graphsplit.planning.analyze import analyze, resolve_params
from graphsplit.planning.codecs import insert_codecs
from graphsplit.planning.cut import choose_boundary, compute_taint, facts, module_owner
from graphsplit.planning.meta import analysis_view
from graphsplit.planning.trace import trace_step

MAX_ROUNDS = 8


def trace_and_analyze(
    model: nn.Module, examples: ExampleInputs, trainable: frozenset[str]
) -> Traced:
    """Trace, analyse, and trace into mixed modules whose inputs are all cacheable; repeat."""
    with _cyclic_gc_paused():
        return _trace_and_analyze(model, examples, trainable)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the planning allocates (restored on exit).

    The analysis makes hundreds of thousands of short-lived objects (fake tensors, pytree
    specs, op records) next to a model of thousands of modules and parameters, so collections
    keep triggering and each older-generation one walks every one of those long-lived objects:
    about a tenth of the planning's CPU time on SDXL. Reference counting still frees what is
    not in a cycle; cycles made meanwhile are collected by the first collection afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _trace_and_analyze(
    model: nn.Module, examples: ExampleInputs, trainable: frozenset[str]
) -> Traced:
    param_names = {id(param): name for name, param in model.named_parameters()}
    leaves = _initial_leaves(model)
    notes: list[str] = []
    traced = _trace_once(model, examples, param_names, leaves, trainable)
    for _ in range(MAX_ROUNDS):
        expand = _mixed_calls_worth_tracing(traced, trainable) & leaves
        if not expand:
            break
        try:
            finer = _trace_once(model, examples, param_names, leaves - expand, trainable)
            choose_boundary(finer.graph, trainable)  # a finer trace must still have a cut
        except Exception as exc:  # any failure inside library code: keep the module whole
            notes.append(f"kept {', '.join(sorted(expand))} whole: {_why(exc)}")
            break
        traced = finer
        leaves = leaves - expand
        notes.append(
            f"traced into {', '.join(sorted(expand))}: it mixes frozen and trainable "
            "parameters and its inputs are cacheable"
        )
    return replace(traced, notes=traced.notes + tuple(notes))


def _why(exc: Exception) -> str:
    """One line for the report: why tracing into a module was given up."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, SplitError):
        return f"split inside it has no valid cut ({first_line})"
    if isinstance(exc, TraceError):
        return f"tracing into it failed ({first_line})"
    return f"tracing into it failed ({type(exc).__name__}: {first_line})"


def _trace_once(
    model: nn.Module,
    examples: ExampleInputs,
    param_names: dict[int, str],
    leaves: frozenset[str],
    trainable: frozenset[str],
) -> Traced:
    with analysis_view(model):

        def recorded(node: fx.Node) -> bool:
            return not _is_trainable_call(node, model, trainable)

        traced = trace_step(model, examples.values[0], leaves, record=recorded)
        insert_codecs(traced.graph)
        calls = frozenset(n for n in traced.graph.nodes if _is_trainable_call(n, model, trainable))
        analyze(traced, model, examples, trainable_calls=calls)
    resolve_params(traced, model, param_names)
    return traced


def _is_trainable_call(node: fx.Node, model: nn.Module, trainable: frozenset[str]) -> bool:
    """A call into a module that holds a trainable parameter: it runs in stage 2 regardless."""
    owner = module_owner(node)
    if owner is None:
        return False
    module = model.get_submodule(owner.target)
    return any(name in trainable for name, _ in module.named_parameters(prefix=owner.target))


def _initial_leaves(model: nn.Module) -> frozenset[str]:
    return frozenset(
        name
        for name, module in model.named_modules()
        if name and next(module.parameters(), None) is not None
    )


def _mixed_calls_worth_tracing(traced: Traced, trainable: frozenset[str]) -> frozenset[str]:
    """Leaf modules that mix frozen and trainable parameters and are fed cacheable values."""
    taint = compute_taint(traced.graph, trainable)
    found = set()
    for node in traced.graph.nodes:
        owner = module_owner(node)
        if owner is None:
            continue
        inputs = [arg for arg in node.all_input_nodes if arg is not owner]
        params = facts(owner).params
        mixed = bool(params & trainable) and bool(params - trainable)
        if mixed and inputs and not any(arg in taint for arg in inputs):
            found.add(owner.target)
    return frozenset(found)
