"""Planning: a training step in, two stages out. One module per pipeline step.

``trace`` (step -> fx graph with meta values) -> ``analyze`` (node facts: batch dim, bytes,
FLOPs, random draws, sample mixing) -> ``cut`` (taint, then the min-cut that chooses the
boundary) -> ``codegen`` (stage 1 and stage 2 as GraphModules). ``codecs`` lets non-tensor
values cross the boundary; ``meta`` and ``frozen`` are the helpers the steps share.
"""
