"""``torch.compile``'d modules planned as the modules they wrap.

Training scripts compile the model before the loop (``unet = torch.compile(unet)``, a
Trainer's ``torch_compile=True``, ``accelerator.prepare`` with a dynamo backend, a frozen
``text_encoder = torch.compile(text_encoder)``). The step then calls a
``torch._dynamo.eval_frame.OptimizedModule`` whose ``_orig_mod`` is the user's module: the same
parameters, registered under ``_orig_mod.``, so ``named_parameters()`` of a model holding
``unet`` gives ``unet._orig_mod.conv_in.weight``.

Planning cannot run dynamo: torch.fx refuses to trace a dynamo-optimized function, and the
analysis runs modules on fake ``meta`` tensors, which a compile would only slow down. So for
the length of the planning a call of a compiled module is a call of its ``_orig_mod``: the
trace records ``unet._orig_mod`` (one node if a leaf, its code if traced into), the analysis
runs the original module's code. Generated stage code calls the user's compiled object again
where the whole module is one call (:mod:`graphsplit.planning.codegen.compiled_calls`), so the
compiled module keeps running compiled where the step ran it as a whole.

Glossary:
    compiled module: an ``OptimizedModule``; its *original* is ``_orig_mod``.

In: the planning's patcher. Out: compiled modules answer calls with their original's:

    plan_compiled_modules_as_written(patcher)
    original_module(module) -> nn.Module | None   # ``_orig_mod`` of a compiled module
"""

from __future__ import annotations

import threading
from typing import Any

from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from graphsplit.planning.patching.patcher import Patcher

__all__ = ["original_module", "plan_compiled_modules_as_written"]


def original_module(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile``'d ``module`` wraps (its ``_orig_mod``); ``None`` if
    ``module`` is not compiled."""
    return module._orig_mod if isinstance(module, OptimizedModule) else None


def plan_compiled_modules_as_written(patcher: Patcher) -> None:
    """Calls of compiled modules run their original module in this thread until the patcher
    exits; other threads (a training loop beside the planning) still run them compiled.

    The original is called as a module (``_orig_mod(*args)``), so its hooks run and the trace
    sees one module call at the original's path. Hooks registered on the compiled wrapper
    itself are skipped while planning (torch.compile's docs advise registering them on the
    module being compiled).
    """
    planning_thread = threading.get_ident()
    compiled_call = OptimizedModule.__call__

    def call_original(self: OptimizedModule, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != planning_thread:
            return compiled_call(self, *args, **kwargs)
        return self._orig_mod(*args, **kwargs)

    patcher.patch_method(OptimizedModule, "__call__", call_original)
