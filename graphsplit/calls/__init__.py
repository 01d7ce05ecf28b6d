"""The module-level path: cache frozen module calls' outputs, run the step's Python in stage 2.

Where the whole-step trace (:mod:`graphsplit.planning`) refuses a step, :func:`split_calls`
splits it at the granularity of frozen module calls instead: stage 1 runs the step until every
cached call has run and returns those calls' outputs; stage 2 runs the user's own step eagerly,
the cached calls answered from the cache by stand-in forwards (:mod:`.holders`).

A call is cached only when its exactness is proven on the example batch (:mod:`.analysis`,
verdicts in :mod:`.verdicts`): its inputs carry no autograd history (no trainable parameter),
are bit-equal when the step runs under two different seeds of torch, numpy and ``random`` (no
random draw, no state that changes from step to step), it draws no random numbers itself, it
leaves its inputs alone and the step never mutates its outputs in place, and its outputs are
tensors.

Modules: generators (seeded runs), module_calls (routing frozen modules' calls), outputs
(flatten / rebuild call outputs), provenance (comparing call inputs across runs), verdicts,
analysis, call_plan, holders, stages, call_report (:class:`CallSplit`), call_split.
"""

from graphsplit.calls.call_report import CallSplit
from graphsplit.calls.call_split import split_calls
from graphsplit.calls.verdicts import CallVerdict, Verdict

__all__ = ["CallSplit", "CallVerdict", "Verdict", "split_calls"]
