"""Frozen code that reads tensor values: run as one opaque stage-1 step, or answered.

When the trace meets code that reads a tensor's value (``.tolist()``, a boolean mask), the
innermost user or library function around it is found (``sites``), run for real on the example
batch (``example_run``) and recorded as one node; a value read in code that also trains is
answered with the example's value and checked in stage 1 (``value_reads``).
"""
