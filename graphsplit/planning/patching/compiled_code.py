"""``torch.compile``'d code while planning: a compiled module is the module it wraps; a
compiled function is refused, naming the user's line.

Training scripts compile the model before the loop (``unet = torch.compile(unet)``, a
Trainer's ``torch_compile=True``, ``accelerator.prepare`` with a dynamo backend, a frozen
``text_encoder = torch.compile(text_encoder)``). The step then calls a
``torch._dynamo.eval_frame.OptimizedModule`` whose ``_orig_mod`` is the user's module: the same
parameters, registered under ``_orig_mod.``, so ``named_parameters()`` of a model holding
``unet`` gives ``unet._orig_mod.conv_in.weight`` (graphsplit keeps torch's names).

Planning cannot run dynamo: torch.fx refuses to trace a dynamo-optimized function, and the
analysis runs modules on fake ``meta`` tensors, which a compile would only slow down. So for
the length of the planning a call of a compiled module is a call of its ``_orig_mod``: the
trace records ``unet._orig_mod`` (one node, named ``unet`` as the user's code names it, if a
leaf; its code if traced into), the analysis runs the original module's code. Generated stage
code calls the user's compiled object again where the whole module is one call
(:mod:`graphsplit.planning.codegen.compiled_calls`).

A compiled *function* the step calls (``loss_fn = torch.compile(loss_fn)``) has no module to
stand for it, and tracing its Python code would plan other numerics than the compiled code the
step runs (inductor's fusions round differently): planning refuses it where it is called, with
the fix (call the function as written and compile stage 2, or ``path="calls"``, which runs
the step's code as it is). Dynamo's wrapper of a compiled function (``compile_wrapper``) first
calls ``set_eval_frame``, a global of ``torch._dynamo.eval_frame`` looked up per call: that is
where the refusal is raised (torch.fx's own check is a local of the wrapper).

Glossary:
    compiled module: an ``OptimizedModule``; its *original* is ``_orig_mod``.

In: the planning's patcher. Out: compiled modules answer with their original, compiled
functions refuse, in the planning thread:

    plan_compiled_code_as_written(patcher, model)
    original_module(module) -> nn.Module | None   # ``_orig_mod`` of a compiled module
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch.fx as fx
from torch import nn
from torch._dynamo import eval_frame
from torch._dynamo.eval_frame import OptimizedModule

from graphsplit.errors import Fix, TraceError, user_error
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.rules.user_lines import current_line

__all__ = ["original_module", "plan_compiled_code_as_written"]

ORIGINAL = "_orig_mod"
"""The attribute (and path component) under which a compiled module holds its original."""


def original_module(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile``'d ``module`` wraps (its ``_orig_mod``); ``None`` if
    ``module`` is not compiled."""
    return getattr(module, ORIGINAL) if isinstance(module, OptimizedModule) else None


def plan_compiled_code_as_written(patcher: Patcher, model: nn.Module) -> None:
    """Until the patcher exits, in this thread: a compiled module's call runs its original
    module; a compiled function's call raises :class:`TraceError`. Other threads (a training
    loop beside the planning) still run both compiled.

    A module of ``model`` compiled in place (``module.compile()``, which diffusers'
    ``compile_repeated_blocks`` calls per block) keeps its ``_compiled_call_impl`` aside for
    the planning, so its call runs its own code; the stage code calls it as a module, which
    runs it compiled again. (An attribute of the instance: a thread running ``model`` beside
    the planning runs those modules uncompiled for that long.)

    The original is called as a module (``_orig_mod(*args)``), so its hooks run and the trace
    sees one module call at the original's path. A hook registered on the compiled wrapper
    itself would run around that call in the step but not in the plan: refused, naming the
    fix (register it on the original, as torch.compile's docs advise).
    """
    planning_thread = threading.get_ident()
    compiled_call = OptimizedModule.__call__
    set_eval_frame = eval_frame.set_eval_frame

    def call_original(self: OptimizedModule, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != planning_thread:
            return compiled_call(self, *args, **kwargs)
        if any(map(bool, (self._forward_pre_hooks, self._forward_hooks, self._backward_hooks))):
            _refuse_wrapper_hooks(self)
        return _named_for_the_user(getattr(self, ORIGINAL)(*args, **kwargs))

    def refuse_compiled_function(callback: Any) -> Any:
        caller = sys._getframe(1).f_code
        if (
            threading.get_ident() == planning_thread
            and caller.co_name == "compile_wrapper"
            and caller.co_filename == eval_frame.__file__
        ):
            _refuse_compiled_function()
        return set_eval_frame(callback)

    for module in model.modules():
        if vars(module).get("_compiled_call_impl") is not None:
            patcher.patch(module, "_compiled_call_impl", None)
    patcher.patch_method(OptimizedModule, "__call__", call_original)
    patcher.patch(eval_frame, "set_eval_frame", refuse_compiled_function)


def _named_for_the_user(result: Any) -> Any:
    """A leaf call of ``unet._orig_mod`` as a node named ``unet`` (the name the step's code
    calls it by), so the boundary keys read ``text_encoder_0``, not ``text_encoder__orig_mod_0``.
    """
    node = result.node if isinstance(result, fx.Proxy) else None
    if node is not None and node.op == "call_module" and node.target.endswith(f".{ORIGINAL}"):
        node._rename(node.target[: -len(ORIGINAL) - 1].replace(".", "_"))
    return result


def _refuse_compiled_function() -> None:
    raise user_error(
        TraceError,
        "The step calls a torch.compile'd function: graphsplit plans the step's Python code, "
        "and the compiled function's numerics are not its code's (torch.fx cannot trace "
        "a dynamo-optimized function either). A torch.compile'd module is planned as the "
        "module it wraps; a function has no module to stand for it.",
        source=current_line(),
        fix=Fix(
            "call the function as written inside the step and compile stage 2 instead "
            "(stage2 = torch.compile(split.stage2)), or compile a module rather than a "
            "function; split(..., path='calls') runs the step as written, compiled calls included"
        ),
    )


def _refuse_wrapper_hooks(module: OptimizedModule) -> None:
    kind = type(getattr(module, ORIGINAL)).__name__
    raise user_error(
        TraceError,
        f"The step calls a torch.compile'd {kind} that has hooks registered on the compiled "
        "wrapper itself; graphsplit plans the module it wraps, whose hooks these are not.",
        source=current_line(),
        fix=Fix(
            "register the hooks on the module before compiling it, or on the original "
            "(compiled._orig_mod.register_forward_hook(...)), where the compiled module runs "
            "them too"
        ),
    )
