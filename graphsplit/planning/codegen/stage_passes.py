"""What the traced step implied for the stages beyond their nodes: size checks, checkpointing.

:func:`~graphsplit.planning.codegen.stages.build_stage2` copies the stage-2 nodes out of the traced
graph, then calls :func:`finish_stage2` once, which applies, in order:

- :func:`~graphsplit.planning.rules.size_guards.recheck_size_guards`: the Python values the trace
  derived from sizes (ints, branches, floats, text given to a module) are recomputed and
  checked, so a plan made for another resolution stops with a clear error.

Once the stage-2 module is built (its attributes are the model's), it calls
:func:`finish_stage2_module`, which applies:

- :func:`~graphsplit.planning.rules.checkpoint.recheckpoint`: the stage-2 part of each region the
  step ran under ``torch.utils.checkpoint.checkpoint`` becomes one ``checkpoint`` call, of the
  module itself or of a region module outlined from the stage (it needs the built stage: the
  region module reads the stage's attributes).

:func:`~graphsplit.planning.codegen.stages.build_stage1` calls :func:`finish_stage1` before its
output, which checks the sizes stage 1 can read (before anything is cached):

- :func:`~graphsplit.planning.rules.size_guards.refuse_unchecked_size_guards`: a value read from a
  size that neither stage can recompute is refused, at split time;
- :func:`~graphsplit.planning.rules.baked_sizes.check_numbers`: the numbers the cut baked into
  stage 2 (sizes read from frozen-only data) are recomputed from the batch and checked;
- :func:`~graphsplit.planning.cut.twin_reads.check_twin_reads`: each read stage 2 makes on a
  boundary tensor in place of a tensor it lacks gives the same value on both;
- :func:`~graphsplit.planning.cut.number_twins.check_number_twins`: each number stage 2 reads
  as a size of a boundary tensor equals that size;
- :func:`~graphsplit.planning.rules.size_guards.recheck_size_guards_in_stage1`: every size guard
  stage 1 can recompute, stage 2's included, is rechecked here, so ``cache()`` never writes a
  batch no plan could train;
- :func:`~graphsplit.planning.rules.size_guards.hoist_checks`: checks that read only the inputs'
  sizes move before the frozen work, so a batch of another size is refused before it runs.

In: the stage graph being built, the traced graph, the cut, the node map. Out: the same
stage graph, changed in place:

    finish_stage1(stage, graph, cut, env) -> {attribute: value}   # for the stage module
    finish_stage2(stage, graph, cut, env) -> None
    finish_stage2_module(stage_module) -> stage_module
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from graphsplit.artifacts import Cut
from graphsplit.planning.cut.number_twins import check_number_twins
from graphsplit.planning.cut.twin_reads import check_twin_reads
from graphsplit.planning.opaque.value_reads import hold_check_sources
from graphsplit.planning.rules.baked_sizes import check_numbers
from graphsplit.planning.rules.checkpoint import recheckpoint
from graphsplit.planning.rules.size_guards import (
    CheckSources,
    hoist_checks,
    recheck_size_guards,
    recheck_size_guards_in_stage1,
    refuse_unchecked_size_guards,
)


def finish_stage1(
    stage: fx.Graph,
    graph: fx.Graph,
    cut: Cut,
    env: dict[fx.Node, fx.Node],
    *,
    as_in_0_2: bool = False,
) -> dict[str, Any]:
    """Apply the stage-1 passes listed in the module docstring; returns the attributes the
    checks read (the user's lines they name, kept out of the fingerprinted code).

    ``as_in_0_2`` gives stage 1 with only the size checks graphsplit 0.2 put there: its code
    is kept as an alias of the cache fingerprint (see ``recheck_size_guards_in_stage1``).
    """
    if not as_in_0_2:
        refuse_unchecked_size_guards(graph, cut)
    sources = CheckSources(stage)
    check_numbers(stage, graph, cut, env, sources)
    check_twin_reads(stage, cut, env, sources)
    check_number_twins(stage, cut, env, sources)
    recheck_size_guards_in_stage1(stage, graph, cut, env, sources, as_in_0_2=as_in_0_2)
    hold_check_sources(stage, sources)  # the value checks' lines (planning/opaque/value_reads.py)
    hoist_checks(stage)
    return sources.held()


def finish_stage2(stage: fx.Graph, graph: fx.Graph, cut: Cut, env: dict[fx.Node, fx.Node]) -> None:
    """Apply the stage-2 passes listed in the module docstring."""
    recheck_size_guards(stage, graph, cut, env)


def finish_stage2_module(stage: fx.GraphModule) -> fx.GraphModule:
    """Apply the passes on the built stage-2 module listed in the module docstring."""
    recheckpoint(stage)
    return stage
