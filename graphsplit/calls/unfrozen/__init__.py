"""Trainable modules the step only ever runs under ``no_grad``: what the module-level path's
refusal names when it finds no frozen call to cache.

TRL's ``KTOTrainer`` leaves its ``ref_model`` with ``requires_grad=True`` and calls it only
inside ``torch.no_grad()``. Its parameters count as trainable, so nothing of it may be cached
(an optimizer could move them), and the refusal said only "the step calls no frozen module";
the fix that works, freezing the reference, was named nowhere. The refusal now runs the step
once more with the outermost all-trainable modules watched, and names those whose every call
ran with gradients off, with the line of the first call and the fix.

    under_no_grad_only(step, trainable, run) -> {path: "file:line  code"}
    no_frozen_call(listed, unfrozen) -> SplitError
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphsplit.calls.module_calls import trainable_parameter_ids
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import describe, frame_location, user_frame


def under_no_grad_only(
    step: nn.Module, trainable: frozenset[str], run: Callable[[], Any]
) -> dict[str, str]:
    """The outermost modules of ``step`` holding only trainable parameters that ``run()``
    called, every time with gradients disabled, by path: the line of their first call."""
    moving = trainable_parameter_ids(step, trainable)
    watched = {
        path: module
        for path, module in step.named_modules()
        if path and _only_trainable(module, moving)
    }
    outermost = {
        path: module
        for path, module in watched.items()
        if not any(path.startswith(other + ".") for other in watched)
    }
    seen: dict[str, tuple[str, bool]] = {}

    def watcher(path: str) -> Callable[..., None]:
        def called(_module: nn.Module, _args: Any) -> None:
            line, only = seen.get(path) or (describe(frame_location(user_frame())), True)
            seen[path] = (line, only and not torch.is_grad_enabled())

        return called

    handles = [
        module.register_forward_pre_hook(watcher(path)) for path, module in outermost.items()
    ]
    try:
        run()
    except Exception:  # the step ran twice in the probes; a third failing names nothing
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return {path: line for path, (line, only) in seen.items() if only}


def _only_trainable(module: nn.Module, moving: frozenset[int]) -> bool:
    params = list(module.parameters())
    return bool(params) and all(id(param) in moving for param in params)


NOTHING_FROZEN_FIX = Fix(
    "train the step as it is; or freeze the modules whose work should be cached "
    "(requires_grad_(False) or frozen=...) and split again"
)


def no_frozen_call(listed: str, unfrozen: dict[str, str], *, called: bool) -> SplitError:
    """The module-level path's refusal when no call is cacheable; where ``unfrozen`` names
    modules only ever run under ``no_grad``, the fix is to freeze them. Where the step
    ``called`` no frozen module at all, nothing can be cached by any path: its fix is
    :data:`NOTHING_FROZEN_FIX`, which ``split(path="auto")`` puts first."""
    reason = (
        "the module-level path found no frozen module call whose inputs are a function "
        f"of the sample alone:\n{listed}"
    )
    if not unfrozen and not called:
        return user_error(
            SplitError,
            "nothing of this step can be cached: it calls no frozen module (every module it "
            "runs has parameters that train), so any split would leave all its work in stage 2.",
            fix=NOTHING_FROZEN_FIX,
        )
    if not unfrozen:
        return user_error(
            SplitError,
            reason,
            fix=Fix(
                "freeze the modules whose work should be cached (requires_grad_(False) or "
                "frozen=...), call them in eval mode on inputs computed from the batch alone, "
                "and draw random numbers after those calls"
            ),
        )
    runs = "\n".join(
        f"  {path}: every call ran under no_grad (first at {line}), yet its parameters "
        "require grad, so it counts as trained and nothing of it is cached"
        for path, line in unfrozen.items()
    )
    frozen = "; ".join(f"{path}.requires_grad_(False)" for path in unfrozen)
    return user_error(
        SplitError,
        f"{reason}\n{runs}",
        fix=Fix(
            f"if {', '.join(unfrozen)} is not trained, freeze it before splitting ({frozen}): "
            "no gradient reaches it, and frozen its calls can be cached"
        ),
    )
