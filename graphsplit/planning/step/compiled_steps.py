"""A step that is itself ``torch.compile``'d is refused, naming the fix.

``split(torch.compile(training_step), ...)`` hands graphsplit dynamo's wrapper: the step's
Python code runs only inside dynamo, and torch.fx refuses to trace a dynamo-optimized function
("Detected that you are using FX to symbolically trace a dynamo-optimized function"). Tracing
the function the wrapper hides would plan a step that is not the one the user runs: the
compiled step's numerics (inductor's fusions) are not the plain function's, so stage 2 after
stage 1 would not reproduce it bit for bit. The fix keeps both: split the function as written
and compile stage 2, the part that runs every step.

A compiled *module* the step calls (``unet = torch.compile(unet)``) is planned as the module it
wraps (:mod:`graphsplit.planning.patching.compiled_code`); only the step itself is refused.

In: the step callable. Out: nothing, or a :class:`~graphsplit.errors.SplitError`:

    refuse_compiled_step(step)
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch._dynamo.eval_frame import OptimizedModule

from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import describe, frame_location_of

__all__ = ["refuse_compiled_step"]

_COMPILE_STAGE2 = "; to run it compiled, compile stage 2: stage2 = torch.compile(split.stage2)"


def refuse_compiled_step(step: Any) -> None:
    """Raise a :class:`SplitError` when ``step`` is a ``torch.compile``'d function or module
    (also inside ``functools.partial`` layers)."""
    while isinstance(step, functools.partial):
        step = step.func
    if isinstance(step, OptimizedModule):
        original = step._orig_mod
        what = f"the torch.compile'd {type(original).__name__}"
        fix = (
            f"split the module as written (graphsplit.split(model._orig_mod, ...)){_COMPILE_STAGE2}"
        )
        source = _definition(type(original).forward)
    elif callable(step) and hasattr(step, "_torchdynamo_orig_callable"):
        original = step._torchdynamo_orig_callable
        name = getattr(original, "__qualname__", type(original).__name__)
        what = f"the torch.compile'd function {name}"
        fix = f"split the function as written (graphsplit.split({name}, ...)){_COMPILE_STAGE2}"
        source = _definition(original)
    else:
        return
    raise user_error(
        SplitError,
        f"graphsplit.split got {what}: graphsplit splits the step's Python code, which "
        "torch.compile's wrapper hides (torch.fx cannot trace a dynamo-optimized function), "
        "and a compiled step's numerics are not its code's.",
        source=source,
        fix=Fix(fix),
    )


def _definition(function: Any) -> str | None:
    """``file:line  def ...`` of ``function``'s definition, when it has Python code."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return None
    return describe(frame_location_of(code.co_filename, code.co_firstlineno))
