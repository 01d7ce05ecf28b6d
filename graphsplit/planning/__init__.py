"""Planning: a training step in, two stages out. One module per pipeline step.

The steps, in order (each hands the next a typed artifact from :mod:`graphsplit.artifacts`):

    inputs    bind the example batch; meta twins at two batch sizes       -> ExampleInputs
    rounds    trace + analyze, tracing into mixed modules when worth it  -> Traced
      trace     the step as a torch.fx graph with (fake) meta values and guards
      inplace   in-place writes rewritten as dataflow, or refused
      codecs    non-tensor values cross the boundary as tensors
      analyze   node facts: batch layout, bytes, FLOPs, random draws      -> NodeFacts
    cut       taint, then the min-cut that chooses the boundary            -> Cut
    codegen   stage 1 and stage 2 as GraphModules; saved stage files

Helpers the steps share: ``interpret`` (torch.fx Interpreters that run nodes on meta and record
their ATen ops), ``mixing`` (does an op mix samples of the batch?), ``meta`` (the meta-device
view of a model and the analysis's FakeTensorMode), ``patches`` (Python-level patches active
while tracing, and the mode that records random draws), ``rewrites`` (graph passes: input
names, devices), ``rng`` (random draws while tracing),
``user_code`` (the user's ``file:line`` behind an op), ``frozen`` (the ``frozen=`` argument).
The boundary is chosen in ``cut`` and only there.
"""
