"""What a node reads, walking back through the nodes a rule lets the walk pass.

Several rules ask the same question of a graph: which values does this node depend on, up to
the first node that is not of some kind? The cut's recompute prices walk back through cheap
work to the frozen work and inputs under it; a size check hoisted before the frozen work walks
back through size inspections to the stage's inputs. One walk answers both.

    reads_through(node, passes) -> (passed, ends)
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

__all__ = ["reads_through"]


def reads_through(
    node: fx.Node, passes: Callable[[fx.Node], bool]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """The nodes ``node`` reads, transitively, walking back through those ``passes`` accepts.

    Returns ``(passed, ends)``: the nodes the walk went through, and the nodes it stopped at
    (read by ``node`` or by a passed node, but not accepted by ``passes``).

    >>> graph = fx.Graph()
    >>> x = graph.placeholder("x")
    >>> y = graph.call_function(abs, (x,))
    >>> z = graph.call_function(abs, (y,))
    >>> passed, ends = reads_through(z, lambda n: n.op != "placeholder")
    >>> sorted(n.name for n in passed), sorted(n.name for n in ends)
    (['abs_1'], ['x'])
    """
    passed: set[fx.Node] = set()
    ends: set[fx.Node] = set()
    pending = list(node.all_input_nodes)
    while pending:
        producer = pending.pop()
        if producer in passed or producer in ends:
            continue
        if passes(producer):
            passed.add(producer)
            pending.extend(producer.all_input_nodes)
        else:
            ends.add(producer)
    return passed, ends
