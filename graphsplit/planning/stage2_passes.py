"""What the traced step implied for stage 2 beyond its nodes: size checks, checkpointing.

:func:`~graphsplit.planning.codegen.build_stage2` copies the stage-2 nodes out of the traced
graph, then calls :func:`finish_stage2` once, which applies, in order:

- :func:`~graphsplit.planning.guards.recheck_size_guards`: the Python ints the trace read are
  recomputed and checked, so a plan made for another resolution stops with a clear error;
- :func:`~graphsplit.planning.checkpoint.recheckpoint`: a module call the step ran under
  ``torch.utils.checkpoint.checkpoint`` is checkpointed in stage 2 too.

In: the stage-2 graph being built, the traced graph, the cut, the node map. Out: the same
stage-2 graph, changed in place:

    finish_stage2(stage, graph, cut, env) -> None
"""

from __future__ import annotations

import torch.fx as fx

from graphsplit.artifacts import Cut
from graphsplit.planning.checkpoint import recheckpoint
from graphsplit.planning.guards import recheck_size_guards


def finish_stage2(stage: fx.Graph, graph: fx.Graph, cut: Cut, env: dict[fx.Node, fx.Node]) -> None:
    """Apply the stage-2 passes listed in the module docstring."""
    recheck_size_guards(stage, graph, cut, env)
    recheckpoint(stage, graph, cut, env)
