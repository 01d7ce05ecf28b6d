"""Stage 1's table of user lines is fetched before any check reads it.

``CheckSources`` adds the table (a ``get_attr``) right after the inputs when the first check
needs it; passes insert more checks right after the inputs later (Mllama's stage 1 compares
``cross_attention_mask.shape[1]`` with ``input_ids.shape[1]``), and their line reads must not
land above the table: the generated code read ``graphsplit_check_sources[1]`` before assigning
it (UnboundLocalError).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphsplit.planning.rules.size_guards import CheckSources


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: index for index, node in enumerate(graph.nodes)}


def test_a_check_inserted_after_the_inputs_later_reads_the_table_after_it_is_fetched():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    sources = CheckSources(graph)
    first = sources.node_for("step.py:1  first", after=b)  # creates the table
    with graph.inserting_after(b):  # a later pass: a size read right after the inputs
        size = graph.call_function(getattr, (a, "shape"))
    second = sources.node_for("step.py:2  second", after=size)
    graph.output((first, second))
    graph.lint()
    order = _order(graph)
    assert order[sources.table] < order[first] and order[sources.table] < order[second]
    assert all(order[sources.table] > order[p] for p in (a, b))
    assert second.target is operator.getitem and second.args == (sources.table, 1)
    module = fx.GraphModule({CheckSources.ATTRIBUTE: ("x", "y")}, graph)
    assert module(torch.zeros(1), torch.zeros(1)) == ("x", "y")  # the generated code runs
