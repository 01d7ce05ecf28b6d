"""What the user passed to :func:`graphsplit.split`, made ready for the trace.

A function, closure or bound method becomes one step module; the example batch is bound to its
parameters and twinned on ``meta`` at two batch sizes; ``frozen=`` becomes parameter names.
"""
