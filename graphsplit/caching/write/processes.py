"""The processes of an ``accelerate`` launch (or just this one) and how they agree.

Glossary:
    rank: a process's index in the launch, ``accelerator.process_index``; 0 is the main one.
    world: how many processes the launch has, ``accelerator.num_processes``.
    owner: the process that computes and writes a shard: shard ``k`` belongs to rank
        ``k % world``; with one process, every shard is its own.

A step that fails on one process must fail on all of them, or the others wait forever in the
next collective call: every step here ends with one (``broadcast_object_list`` or
``gather_object``) that carries either the result or the error, by exception type and message.

In and out::

    Processes(accelerator | None)
        .on_main(step) -> step()'s result, on every process (or its error, raised everywhere)
        .everywhere(step)                    # raises on all if it failed on any
        .refuse_other_fingerprints(fingerprint) # CacheError if weights, code or boundary differ
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import graphsplit.errors as errors
from graphsplit.caching.format.fingerprint import BINDING_PARTS, Fingerprint
from graphsplit.errors import CacheError, Fix, GraphsplitError, user_error

__all__ = ["Processes"]


class Processes:
    """The launch's processes; see the module docstring."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.rank = 0 if accelerator is None else int(accelerator.process_index)
        self.world = 1 if accelerator is None else int(accelerator.num_processes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, shard: int) -> bool:
        """Whether this process computes and writes ``shard``."""
        return shard % self.world == self.rank

    def on_main(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` on the main process; every process returns its result or raises its
        error."""
        if self.world == 1:
            return step()
        from accelerate.utils import broadcast_object_list

        outcome: list[Any] = [None]
        error: BaseException | None = None
        if self.is_main:
            try:
                outcome = [("ok", step())]
            except Exception as caught:
                error = caught
                outcome = [("error", _describe_error(caught))]
        broadcast_object_list(outcome, from_process=0)
        if error is not None:
            raise error
        status, value = outcome[0]
        if status == "error":
            raise _remote_error(value, 0)
        return value

    def everywhere(self, step: Callable[[], Any]) -> None:
        """Run ``step`` on every process; raise on all of them if it failed on any."""
        if self.world == 1:
            step()
            return
        from accelerate.utils import gather_object

        error: BaseException | None = None
        try:
            step()
            outcome: Any = None
        except Exception as caught:
            error = caught
            outcome = _describe_error(caught)
        outcomes = gather_object([outcome])
        if error is not None:
            raise error
        for rank, described in enumerate(outcomes):
            if described is not None:
                raise _remote_error(described, rank)

    def refuse_other_fingerprints(self, current: Fingerprint) -> None:
        """Refuse to go on when another process holds other weights, code or boundary."""
        if self.world == 1:
            return
        from accelerate.utils import gather_object

        mine = current.to_json()
        for rank, other in enumerate(gather_object([mine])):
            parts = [part for part in BINDING_PARTS if other[part] != mine[part]]
            if parts:
                raise user_error(
                    CacheError,
                    f"process {rank} has other {' and '.join(parts)} than process {self.rank}, so "
                    "their caches would not agree.",
                    fix=Fix(
                        "build the model the same way in every process (seed random "
                        "initialisation, load the same checkpoint) before splitting it"
                    ),
                )


def _describe_error(error: BaseException) -> tuple[str, str, Fix | None]:
    """An error as ``(exception type name, reason, fix)``: what crosses to the other processes
    (the fix only for an error that carries one, see :func:`graphsplit.errors.user_error`)."""
    fix = error.fix if isinstance(error, GraphsplitError) else None
    reason = error.reason if isinstance(error, GraphsplitError) else None
    return type(error).__name__, str(error) if reason is None else reason, fix


def _remote_error(described: tuple[str, str, Fix | None], rank: int) -> GraphsplitError:
    """Rebuild another process's error: its own cache error type and fix, else a CacheError."""
    name, reason, fix = described
    kind = getattr(errors, name, None)
    if not (isinstance(kind, type) and issubclass(kind, CacheError)):
        kind, reason = CacheError, f"{name}: {reason}"
    if fix is None:
        fix = Fix(
            f"see process {rank}'s output for the cause; rerun the same call once it is fixed"
        )
    return user_error(kind, f"process {rank} failed: {reason}", fix=fix)
