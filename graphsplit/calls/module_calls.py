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
from typing import Any

from torch import nn

CallId = tuple[str, int]
"""A call: the module's path in the step module, and its index among that module's calls."""

Handler = Callable[[CallId, nn.Module, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""What a routed call does: ``handler(call, module, forward, args, kwargs) -> output``."""


def frozen_modules(model: nn.Module, trainable: frozenset[str]) -> dict[str, nn.Module]:
    """Every module below ``model`` whose parameters (at least one) are all frozen, by path.

    Told by identity, not by name: ``trainable`` names each parameter once, under its first
    path (``named_parameters`` drops the aliases), and a tied one has others. T5's and BART's
    ``encoder.embed_tokens`` and ``decoder.embed_tokens`` hold the trainable ``shared.weight``:
    judged by their own paths they looked frozen, their lookups were cached, and the shared
    embedding lost that part of its gradient."""
    moving = trainable_parameter_ids(model, trainable)
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if not path:
            continue
        params = list(module.parameters())
        if params and not any(id(param) in moving for param in params):
            found[path] = module
    return found


def trainable_parameter_ids(model: nn.Module, trainable: frozenset[str]) -> frozenset[int]:
    """The ``id`` of every parameter of ``model`` that ``trainable`` names (under any of its
    tied paths)."""
    return frozenset(
        id(param)
        for name, param in model.named_parameters(remove_duplicate=False)
        if name in trainable
    )


def key_of(call: CallId, field: str) -> str:
    """The boundary key of one output field of a call: ``text_encoder__0__last_hidden_state``."""
    path, index = call
    return f"{path.replace('.', '_')}__{index}__{field}"


class CallRouter:
    """Routes the outermost calls of ``modules`` (path -> module) to ``handler``.

    A plain class with slots, not a dataclass: stage 2 makes one per step.
    """

    __slots__ = ("counts", "depth", "handler", "modules", "nested", "order", "outer")

    def __init__(self, modules: dict[str, nn.Module], handler: Handler) -> None:
        self.modules = modules
        self.handler = handler
        self.counts: dict[str, int] = {}
        self.depth = 0
        self.order: list[CallId] = []
        self.outer = ""
        self.nested: set[tuple[str, str]] = set()
        """``(outer, inner)``: ``inner`` was called inside an outermost call of ``outer``."""

    @contextlib.contextmanager
    def installed(self) -> Iterator[CallRouter]:
        """Route the modules' calls inside the block; their own ``forward`` comes back after."""
        saved = self.install()
        try:
            yield self
        finally:
            restore(saved)

    def install(self) -> list[tuple[dict[str, Any], bool, Any]]:
        """Route the modules' calls until :func:`restore` is given what this returns (stage 2
        pairs the two in a ``try`` / ``finally``: a context manager costs a few µs a step)."""
        # The instance dict is written directly: for a plain function that is what
        # ``nn.Module.__setattr__`` ends in, after walking its parameter, buffer and module
        # dicts. The routes are installed per run, not once: a route left on the user's
        # modules between steps would go with them into ``copy.deepcopy`` / pickling (a
        # deep copy's routes still calling the original's forward) and be what the user
        # sees of their model outside a step.
        saved: list[tuple[dict[str, Any], bool, Any]] = []
        try:
            for path, module in self.modules.items():
                instance = module.__dict__
                had = "forward" in instance
                saved.append((instance, had, instance.get("forward")))
                instance["forward"] = self._routed(path, module, module.forward)
        except BaseException:
            restore(saved)
            raise
        return saved

    def _routed(self, path: str, module: nn.Module, forward: Callable[..., Any]) -> Any:
        def routed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                self.nested.add((self.outer, path))
                return forward(*args, **kwargs)
            index = self.counts.get(path, 0)
            self.counts[path] = index + 1
            call = (path, index)
            self.order.append(call)
            self.outer = path
            self.depth += 1
            try:
                return self.handler(call, module, forward, args, kwargs)
            finally:
                self.depth -= 1

        return routed


def restore(saved: list[tuple[dict[str, Any], bool, Any]]) -> None:
    """Give the modules :meth:`CallRouter.install` routed their own ``forward`` back."""
    for instance, had, previous in reversed(saved):
        if had:
            instance["forward"] = previous
        else:
            instance.pop("forward", None)


def needed_routes(
    model: nn.Module,
    frozen: dict[str, nn.Module],
    cached: set[str],
    nested: set[tuple[str, str]],
) -> dict[str, nn.Module]:
    """The frozen modules a stage routes: the modules of ``cached`` calls, and every frozen
    module whose call can hold one of their calls, so that the stage counts exactly the
    outermost calls the probe (every frozen module routed) counted.

    A call of a cached module ``m`` is outermost when no frozen module's call is running. A
    frozen module whose call runs around ``m``'s is either above ``m`` (under any of the paths
    ``m`` is registered at) or called ``m`` without holding it (a module kept in a plain
    attribute or a closure): the probe saw those in ``nested``. Routing them too keeps
    ``m``'s inner calls uncounted; every other frozen module runs without a route.
    """
    paths_of: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths_of.setdefault(id(module), []).append(path)
    keep = set(cached)
    for path in cached:
        for alias in paths_of.get(id(frozen[path]), [path]):
            parts = alias.split(".")
            for end in range(1, len(parts)):
                above = ".".join(parts[:end])
                if above in frozen:
                    keep.add(above)
    keep |= {outer for outer, inner in nested if inner in cached}
    return {path: module for path, module in frozen.items() if path in keep}
