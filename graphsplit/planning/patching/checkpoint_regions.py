"""Checkpoint regions: the nodes traced inside one ``torch.utils.checkpoint.checkpoint`` call.

Glossary:
    checkpoint region: the nodes traced inside one ``torch.utils.checkpoint.checkpoint(fn,
        ...)`` call, tagged ``node.meta["checkpoint"]`` (:func:`record_checkpoints`), so stage
        2 can checkpoint them again (:mod:`graphsplit.planning.rules.checkpoint`).
    checkpoint engine: what torch's own ``checkpoint`` runs, looked up on its module at each
        call: ``_checkpoint_without_reentrant_generator`` or ``CheckpointFunction``.

Every replacement runs torch's own code for a call that holds no traced value, which is every
call another thread makes while a step is traced.

In: the trace's patcher and the tracer. Out: nothing; the replacements are registered with the
patcher; and the options stage 2 passes on:

    record_checkpoints(patcher, tracer) -> None
    CHECKPOINT_OPTIONS: tuple[str, ...]
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_values import contains_proxy

__all__ = ["CHECKPOINT_OPTIONS", "record_checkpoints"]

# Options of checkpoint() that stage 2 passes on (context_fn, a callable, is held by the stage
# module, see graphsplit.planning.rules.checkpoint).
CHECKPOINT_OPTIONS = (
    "use_reentrant",
    "preserve_rng_state",
    "determinism_check",
    "debug",
    "early_stop",
    "context_fn",
)


def record_checkpoints(patcher: Patcher, tracer: Any) -> None:
    """Tag the nodes traced inside each ``torch.utils.checkpoint.checkpoint`` call.

    DiffSynth (``torch.utils.checkpoint.checkpoint(create_custom_forward(block), *args,
    use_reentrant=False)``) and diffusers (``self._gradient_checkpointing_func(block, ...)``,
    which calls ``torch.utils.checkpoint.checkpoint(block.__call__, ...)``) look the function
    up on ``torch.utils.checkpoint`` when they call it, so replacing that attribute sees both.
    Code that took the function earlier (``from torch.utils.checkpoint import checkpoint``;
    transformers' ``functools.partial(checkpoint, **kwargs)`` made by
    ``gradient_checkpointing_enable``) still runs torch's own ``checkpoint``, which looks up its
    two engines when called: those are replaced too (:func:`_record_checkpoint_engines`).
    ``tracer.open_checkpoint(options)`` / ``tracer.close_checkpoint(token)`` bracket the
    traced call; regions nested in a region belong to the outer one.
    """
    module = torch.utils.checkpoint
    original = module.checkpoint

    @functools.wraps(original)
    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        if tracer.computing_meta or not contains_proxy((args, kwargs)):
            return original(function, *args, **kwargs)
        options = {name: kwargs.pop(name) for name in CHECKPOINT_OPTIONS if name in kwargs}
        token = tracer.open_checkpoint(options)
        try:
            return function(*args, **kwargs)
        finally:
            tracer.close_checkpoint(token)

    patcher.patch(module, "checkpoint", checkpoint)
    _record_checkpoint_engines(patcher, tracer, original)


def _record_checkpoint_engines(
    patcher: Patcher, tracer: Any, checkpoint: Callable[..., Any]
) -> None:
    """Tag a call of torch's own ``checkpoint`` (reached by an earlier-taken reference).

    ``checkpoint`` runs ``use_reentrant=False`` through the generator
    ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state, context_fn,
    determinism_check, debug, early_stop, *args, **kwargs)``, advanced once before and once
    after ``fn(*args, **kwargs)``, and ``use_reentrant=True`` through
    ``CheckpointFunction.apply(fn, preserve_rng_state, *args)``; both are module globals it
    looks up on each call. With traced arguments, the stand-ins open a region instead of
    saving tensors (the options differing from ``checkpoint``'s defaults are kept); otherwise
    they are torch's own.
    """
    module = torch.utils.checkpoint
    generator, function_class = (
        module._checkpoint_without_reentrant_generator,
        module.CheckpointFunction,
    )
    engine = inspect.signature(generator)
    signature = inspect.signature(inspect.unwrap(checkpoint))
    defaults = {name: parameter.default for name, parameter in signature.parameters.items()}
    defaults["preserve_rng_state"] = True
    defaults["context_fn"] = module.noop_context_fn

    def options_of(arguments: dict[str, Any], use_reentrant: bool) -> dict[str, Any]:
        changed = {
            name: arguments[name]
            for name in CHECKPOINT_OPTIONS
            if name in arguments and arguments[name] != defaults.get(name)
        }
        return {"use_reentrant": use_reentrant, **changed}

    def without_reentrant(*args: Any, **kwargs: Any) -> Iterator[None]:
        arguments = engine.bind(*args, **kwargs).arguments
        traced = (arguments.get("args", ()), arguments.get("kwargs", {}))
        if tracer.computing_meta or not contains_proxy(traced):
            yield from generator(*args, **kwargs)
            return
        token = tracer.open_checkpoint(options_of(arguments, use_reentrant=False))
        try:
            yield
        finally:
            tracer.close_checkpoint(token)

    class ReentrantCheckpoint:
        @staticmethod
        def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            if tracer.computing_meta or not contains_proxy(args):
                return function_class.apply(function, preserve_rng_state, *args)
            arguments = {"preserve_rng_state": preserve_rng_state}
            token = tracer.open_checkpoint(options_of(arguments, use_reentrant=True))
            try:
                return function(*args)
            finally:
                tracer.close_checkpoint(token)

    patcher.patch(module, "_checkpoint_without_reentrant_generator", without_reentrant)
    patcher.patch(module, "CheckpointFunction", ReentrantCheckpoint)
