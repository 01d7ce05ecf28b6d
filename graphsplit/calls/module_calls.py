"""Route the calls of a step's frozen modules: record them (probe, stage 1) or answer them.

A *frozen module* is a module all of whose parameters (at least one) are frozen. Its calls
are counted per module in the order the step makes them, ``text_encoder`` call 0, 1, ...;
only the outermost calls count (a frozen module called inside another's counted call is that
call's own business). :class:`CallRouter` replaces each frozen module's ``forward`` on the
instance for the duration of a run, so the user's code (``self.text_encoder(ids)``, a
closure's ``vae.encode(...)`` reaching ``vae``'s submodules, a library model calling its
frozen feature encoder) is routed without being edited; hooks the user registered still run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

CallId = tuple[str, int]
"""A call: the module's path in the step module, and its index among that module's calls."""

Handler = Callable[[CallId, nn.Module, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""What a routed call does: ``handler(call, module, forward, args, kwargs) -> output``."""


def frozen_modules(model: nn.Module, trainable: frozenset[str]) -> dict[str, nn.Module]:
    """Every module below ``model`` whose parameters (at least one) are all frozen, by path."""
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if not path:
            continue
        names = [f"{path}.{name}" for name, _ in module.named_parameters()]
        if names and not any(name in trainable for name in names):
            found[path] = module
    return found


def key_of(call: CallId, field: str) -> str:
    """The boundary key of one output field of a call: ``text_encoder__0__last_hidden_state``."""
    path, index = call
    return f"{path.replace('.', '_')}__{index}__{field}"


@dataclass
class CallRouter:
    """Routes the outermost calls of ``modules`` (path -> module) to ``handler``."""

    modules: dict[str, nn.Module]
    handler: Handler

    def __post_init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.depth = 0
        self.order: list[CallId] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[CallRouter]:
        """Route the modules' calls inside the block; their own ``forward`` comes back after."""
        # The instance dict is written directly: for a plain function that is what
        # ``nn.Module.__setattr__`` ends in, after walking its parameter, buffer and module
        # dicts, and stage 2 installs every frozen module's route on every step (276 modules
        # on the tiny SD step: 0.54 ms through ``__setattr__``).
        saved: list[tuple[dict[str, Any], bool, Any]] = []
        try:
            for path, module in self.modules.items():
                instance = module.__dict__
                had = "forward" in instance
                saved.append((instance, had, instance.get("forward")))
                instance["forward"] = self._routed(path, module, module.forward)
            yield self
        finally:
            for instance, had, previous in reversed(saved):
                if had:
                    instance["forward"] = previous
                else:
                    instance.pop("forward", None)

    def _routed(self, path: str, module: nn.Module, forward: Callable[..., Any]) -> Any:
        def routed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return forward(*args, **kwargs)
            index = self.counts.get(path, 0)
            self.counts[path] = index + 1
            call = (path, index)
            self.order.append(call)
            self.depth += 1
            try:
                return self.handler(call, module, forward, args, kwargs)
            finally:
                self.depth -= 1

        return routed
