"""One patcher for everything a trace changes in the process, undone in one place.

A trace replaces objects other code looks up: ``builtins.isinstance`` / ``len`` / ``list`` /
``callable`` / ``range``, ``torch.zeros`` and the other size-vararg factories,
``torch.Tensor.__new__``, ``torch._check_with``, ``torch.utils.checkpoint``'s engines,
``einops.einops.reduce``, the public methods of the step's leaf modules, the tensor methods
that take sizes (``expand``, ``view``, ``repeat``, ...), ``Gamma.rsample``. Every one of them is
registered through a :class:`Patcher` (in the manner of torch.fx's ``_Patcher``), which
undoes them all, last first, however the trace ends: a return, an exception, a
``KeyboardInterrupt``, a generator closed half way.

Glossary:
    patch: one attribute of one object (a module, a class, an instance) replaced while the
        patcher is active; undone exactly: an attribute the object held itself is set back
        to the very object it held, one it inherited or lacked is deleted again.
    meta-reverted patch: a patch of a module's own attribute that code computing a node's
        meta value must not see (the Python builtins: that code holds meta values, never
        traced ones, and runs a million ``isinstance`` calls on a 10k-node chain);
        :func:`patches_reverted` takes them off for such a block. Other replacements stay
        and check ``tracer.computing_meta``.
    tracing thread: the thread that entered the patcher.

Thread safety (the design). Python has one ``builtins`` namespace and one ``torch`` module:
an attribute replaced for one thread is replaced for all, and cannot be made thread-local.
So:

- **Traces are serialised.** Entering a patcher takes :data:`PLANNING_LOCK`, a process-wide
  reentrant lock; a second trace in another thread waits for the first to end. fx's own
  tracer is not thread safe either (it keeps its patcher in the module global
  ``torch.fx._symbolic_trace.CURRENT_PATCHER`` and patches the forward's globals), nor is the
  analysis around a trace (fake-tensor runs, a logger's switch, the collector), so
  ``graphsplit.split`` holds the same lock for its whole planning: concurrent splits wait for
  each other instead of failing. (Traces in parallel, each seeing only its own patches, would
  need fx and the analysis made thread safe first; a trace is seconds, a split rarely
  repeated, so waiting costs little.)
- **Other threads get the originals' answers.** Each replacement answers as the object it
  replaces for every value except the tracing thread's traced values, which no other thread
  holds; the Python builtins also check :meth:`Patcher.traces_here` before answering for a
  traced value. A thread that is not tracing may still see *which* object is bound
  (``builtins.list is list`` is false while a trace runs): Python allows no thread-local
  binding of a builtin.
- **State per thread.** The patchers a thread entered are on that thread's own stack:
  :func:`patches_reverted` in a thread that is not tracing changes nothing, where the former
  process-wide stack let it take another thread's patches off mid-trace.

Caveat: a step that waits, while traced, for another thread that itself calls
``graphsplit.split`` would wait forever; steps do not do that.

In: replacements. Out: a context manager holding them, and a block that lifts the
meta-reverted ones inside it:

    with Patcher() as patcher:
        original = patcher.patch(owner, name, replacement, reverted_for_meta=False)
        original = patcher.patch_method(cls, name, replacement)
        patcher.enter_context(context)      # a thread-local mode, exited with the patches
        patcher.revert_all() / patcher.reapply_all() / with patcher.reverted(): ...
    with patches_reverted(): ...            # this thread's meta-reverted patches lifted
    @one_planning_at_a_time                 # graphsplit.split: the whole planning holds the lock
    patcher.enter_context(cyclic_gc_paused())   # the collector paused (process-wide, no undo
                                                # but this context's: see its docstring)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

__all__ = [
    "PLANNING_LOCK",
    "Patcher",
    "active_patcher",
    "cyclic_gc_paused",
    "one_planning_at_a_time",
    "patches_reverted",
]

PLANNING_LOCK = threading.RLock()
"""Held by a trace (and by ``graphsplit.split`` for its whole planning): one at a time."""

_Function = TypeVar("_Function", bound=Callable[..., Any])


def one_planning_at_a_time(function: _Function) -> _Function:
    """``function`` (``graphsplit.split``) holding :data:`PLANNING_LOCK` while it runs."""

    @functools.wraps(function)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with PLANNING_LOCK:
            return function(*args, **kwargs)

    return locked  # type: ignore[return-value]


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.patchers: list[Patcher] = []  # entered in this thread, innermost last


_THREAD = _ThreadState()


@dataclass(slots=True)
class _Patch:
    """One attribute replaced: ``owner.name`` held ``previous`` itself (``had_own``) or not."""

    owner: Any
    name: str
    replacement: Any
    had_own: bool
    previous: Any
    reverted_for_meta: bool

    def apply(self) -> None:
        _set(self.owner, self.name, self.replacement)

    def revert(self) -> None:
        if self.had_own:
            _set(self.owner, self.name, self.previous)
        elif self.name in vars(self.owner):
            _delete(self.owner, self.name)


def _set(owner: Any, name: str, value: Any) -> None:
    # type.__setattr__ updates a class's slots (``__new__``); object.__setattr__ bypasses a
    # class's own __setattr__ (nn.Module's would file a module or tensor in its tables).
    if isinstance(owner, type):
        type.__setattr__(owner, name, value)
    else:
        object.__setattr__(owner, name, value)


def _delete(owner: Any, name: str) -> None:
    if isinstance(owner, type):
        type.__delattr__(owner, name)
    else:
        object.__delattr__(owner, name)


class Patcher:
    """The changes one trace makes to the process; all undone when the ``with`` block ends."""

    def __init__(self) -> None:
        self._patches: list[_Patch] = []
        # (namespace, name, original, replacement) of the meta-reverted patches: lifted by
        # plain dict stores, once per node the tracer runs on meta.
        self._meta_reverted: list[tuple[dict[str, Any], str, Any, Any]] = []
        self._contexts = contextlib.ExitStack()
        self._thread: int | None = None
        self._lifted = 0  # depth of patches_reverted() blocks now open
        self._applied = False

    # -- registering ----------------------------------------------------------------------
    def patch(
        self, owner: Any, name: str, replacement: Any, *, reverted_for_meta: bool = False
    ) -> Any:
        """Bind ``owner.name`` to ``replacement`` until the patcher exits; return what
        ``owner.name`` gave before (the original, for the replacement to call)."""
        if self._thread != threading.get_ident():
            raise RuntimeError("a Patcher is used only inside its own with block, by its thread")
        original = getattr(owner, name)
        own = vars(owner)
        patch = _Patch(owner, name, replacement, name in own, own.get(name), reverted_for_meta)
        if reverted_for_meta:
            if isinstance(owner, type) or not patch.had_own:
                raise TypeError("a meta-reverted patch replaces a module's own attribute")
            self._meta_reverted.append((own, name, patch.previous, replacement))
        self._patches.append(patch)
        if self._applied and not (reverted_for_meta and self._lifted):
            patch.apply()
        return original

    def patch_method(self, cls: type, name: str, replacement: Any) -> Any:
        """:meth:`patch` for an attribute of a class (``torch.Tensor.__new__``): set through the
        class, so its slots follow; an inherited one is deleted again on exit."""
        if not isinstance(cls, type):
            raise TypeError(f"patch_method patches a class, not {type(cls).__name__}")
        return self.patch(cls, name, replacement)

    def enter_context(self, context: AbstractContextManager[Any]) -> Any:
        """Enter a context (a thread-local torch mode) that exits with the patches."""
        return self._contexts.enter_context(context)

    # -- lifting ------------------------------------------------------------------------------
    def revert_all(self) -> None:
        """Put back every original (the patches stay registered)."""
        for patch in reversed(self._patches):
            patch.revert()
        self._applied = False

    def reapply_all(self) -> None:
        """Bind every replacement again, in the order they were registered (the
        meta-reverted ones stay lifted inside a :func:`patches_reverted` block)."""
        for patch in self._patches:
            if not (patch.reverted_for_meta and self._lifted):
                patch.apply()
        self._applied = True

    @contextlib.contextmanager
    def reverted(self) -> Iterator[None]:
        """The process as it was before the trace, for the block (a user's callback)."""
        self.revert_all()
        try:
            yield
        finally:
            self.reapply_all()

    def traces_here(self) -> bool:
        """Whether the calling thread is this patcher's, with its patches in place."""
        return self._applied and self._thread == threading.get_ident() and not self._lifted

    # -- the with block -------------------------------------------------------------------
    def __enter__(self) -> Patcher:
        PLANNING_LOCK.acquire()
        self._thread = threading.get_ident()
        self._applied = True
        _THREAD.patchers.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            with self._contexts:  # exited last: it was entered after patches it may rely on
                while self._patches:
                    self._patches.pop().revert()
        finally:
            self._meta_reverted.clear()
            self._applied = False
            _THREAD.patchers.remove(self)
            PLANNING_LOCK.release()


def active_patcher() -> Patcher | None:
    """The innermost patcher the calling thread has entered, if any."""
    patchers = _THREAD.patchers
    return patchers[-1] if patchers else None


class patches_reverted:  # lower case: used like the function-style context managers
    """Lift the calling thread's meta-reverted patches for the block; no-op outside a trace.

    A class rather than a generator: it is entered for every op the tracer runs on meta.
    Nested blocks lift once and put back once, when the outermost ends.
    """

    __slots__ = ("_patcher",)

    def __enter__(self) -> None:
        patchers = _THREAD.patchers
        patcher = self._patcher = patchers[-1] if patchers else None
        if patcher is not None:
            if not patcher._lifted and patcher._applied:
                for namespace, name, original, _ in reversed(patcher._meta_reverted):
                    namespace[name] = original
            patcher._lifted += 1

    def __exit__(self, *exc_info: object) -> None:
        patcher = self._patcher
        if patcher is not None:
            patcher._lifted -= 1
            if not patcher._lifted and patcher._applied:
                for namespace, name, _, replacement in patcher._meta_reverted:
                    namespace[name] = replacement


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the planning allocates (restored on exit).

    The planning makes hundreds of thousands of short-lived objects (fake tensors, pytree
    specs, op records; the min-cut's flow network and networkx's residual copy, 100k edges on
    a 10k-node chain) next to a model of thousands of modules and parameters, so collections
    keep triggering and each older-generation one walks every one of those long-lived objects:
    about a tenth of the analysis's CPU time on SDXL, and it doubled the cut's. Reference
    counting still frees what is not in a cycle; cycles made meanwhile are collected by the
    first collection afterwards. The analysis (``leaf_rounds``) and the cut pause it separately:
    pausing the whole split instead cost more, its deferred collection walks everything the
    split allocated. Nested pauses leave the collector as the outer one found it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
