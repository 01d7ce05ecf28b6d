"""``int()`` of a traced size stays traced: one plan serves every size a step turns into an int.

diffusers' ``FluxPipeline._unpack_latents`` starts with ``height = 2 * (int(height) //
(vae_scale_factor * 2))``; DiffSynth and many user steps write ``int(h)`` the same way. Python
asks a traced value's ``__int__`` for an exact ``int`` (a subclass is deprecated and copied), so
the tracer had to answer with the meta value and guard it: the plan held ``32`` and a batch of
another height broke the guard and paid a new plan, about one ``split()``. torch.compile keeps
such an ``int()`` symbolic because it reads the bytecode; a torch.fx trace only sees
``__int__``.

So the tracer notes each *int site*: a function of the step's code (the user's or a library's,
never torch's, graphsplit's or Python's) that called ``int()`` on a traced value whose meta value
is an ``int`` (a size, or arithmetic on sizes). Every later trace runs that function with its
global name ``int`` bound to :func:`traced_int`, which returns such a traced value itself (the
same number: ``int`` of an ``int`` is that ``int``) and is Python's ``int`` for anything else. The
size then flows on as a traced value, the way ``x.shape[2]`` does: torch ops record it, and
every place Python reads its number (``range``, ``bool``, a slice, ``str``; ``hash`` and
``repr`` too, for the stand-in's values and arithmetic on them: :func:`_reads_its_number`)
still guards it, and its text (``f"{n}"``) is guarded when read (the tracer's ``concrete``),
not once it reaches a node. Not ``type(n) is int`` in a function the value is passed to: that
sees the proxy, unguarded (tests/planning/test_int_calls_adversarial.py pins it as a hole).
The trace that found a new site is made again at once (:func:`trace_step`'s loop), so the
first plan is already the one without the guard.

Only code that uses the name ``int`` for calls alone is rebound (``isinstance(x, int)`` or
``type(x) is int`` in the same function would see the stand-in): :func:`_rebound_code` checks
every instruction that names it. Functions that cannot be found from their frame (a closure, a
comprehension) keep Python's ``int`` and the guard. A trace that fails while an int site
answered a traced value is made again without those sites (:meth:`IntSites.traced`, a
library that rejects it: ``json.dumps(int(h))``); a plan the analysis refuses after such a
trace (``float(int(h).bit_length())``) is made again by the planner with those sites declined
(:meth:`IntSites.collecting`, :meth:`IntSites.declining`, used by ``api._Planner.plan``). So
a step is not refused because of them.

Glossary:
    int site: a function whose code called ``int()`` on a traced int-valued value; held by
        :data:`INT_SITES` for the whole process (code is the same code in every trace).
    stand-in: :func:`traced_int`, bound to :data:`STAND_IN_NAME` in the function's globals
        (kept there for good: a frame of the rebound code may outlive the trace in another
        thread), the code's ``int`` renamed to it for the duration of each trace.

In: the frame that called ``int()`` on a traced value (from ``TracedValue.__int__``). Out:

    INT_SITES.traced(trace_once) -> Traced  # the trace, made again as said above
    INT_SITES.note(frame) -> bool           # a new site: the trace must be made again
    INT_SITES.rebind(patcher) -> None       # at the start of a trace: every site's code
    with INT_SITES.collecting() as used: ...   # the planner: sites that answered, any trace
    with INT_SITES.declining(used): ...        # the planner again, Python's int there
    handed_out(node) -> bool                # the stand-in returned it, or arithmetic on one
    traced_int(*args, **kwargs)             # what the rebound code calls
"""

from __future__ import annotations

import contextlib
import dis
import gc
import operator
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from graphsplit.planning.patching.originals import python_isinstance
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.rules.user_lines import is_internal
from graphsplit.planning.tracing.proxies import TracedValue

__all__ = ["INT_SITES", "STAND_IN_NAME", "IntSites", "handed_out", "traced_int"]

STAND_IN_NAME = "_graphsplit_traced_int"
_CALL_LOADS = ("NULL + int", "int + NULL")  # LOAD_GLOBAL's call form: 3.11-3.12, 3.13+
_PYTHON_INT = int
_HANDED_OUT = "graphsplit_int_of_a_site"  # node.meta: the stand-in returned it (handed_out)
# A trace, again with the sites it found, again without those that failed. Each trace but the
# last finds a new site or declines one, so the bound is only met by a chain of sites each
# reached only once the one before is traced (f(int(h)) -> g(int(n)) -> ...): a process that
# already knows the first sites goes further in as many traces, so the bound is set well above
# any such chain seen for every process to make the same plan (4 made a chain of five sites
# trace differently in a fresh process and in one that had split the step before).
_MAX_TRACES = 32
_Traced = TypeVar("_Traced")


def traced_int(*args: Any, **kwargs: Any) -> Any:
    """Python's ``int``, except that a traced value holding an ``int`` is returned as it is."""
    if len(args) == 1 and not kwargs and python_isinstance(args[0], TracedValue):
        value = args[0]
        if type(value.eager_value()) is _PYTHON_INT:  # not a bool, a float, a tensor
            INT_SITES.used(sys._getframe(1).f_code)
            value.node.meta[_HANDED_OUT] = True
            return value
    return _PYTHON_INT(*args, **kwargs)


def _reads_its_number(patcher: Patcher, name: str) -> Callable[[TracedValue], Any]:
    """``hash()`` or ``repr()`` of a traced int the stand-in returned (or arithmetic on one):
    the number's, guarded.

    A proxy hashes by identity and shows ``Proxy(name)``, so ``int(w) in {8, 16}``,
    ``table.get(int(w), 1.0)`` or ``"%r" % int(w)`` would silently take the branch or text of
    no number at all (no guard records it) where eager code, given Python's int, took the
    number's. The stand-in hands such code a traced int where it had a Python one, so on the
    values it returned these reads read the number, as ``str`` does (torch's, graphsplit's
    and Python's own code keep the proxy's answers; a size read straight off a shape keeps
    its own rules, planning/tracing/proxies.py)."""
    original = getattr(TracedValue, name)
    number_read = getattr(_PYTHON_INT, name)

    def read(self: TracedValue) -> Any:
        if (
            type(self) is TracedValue  # not an attribute: reading it would make its node
            and patcher.traces_here()
            and type(self.eager_value()) is _PYTHON_INT
            and not is_internal(sys._getframe(1).f_code.co_filename)
            and handed_out(self.node)
        ):
            return number_read(self.tracer.concrete(self, operator.index))
        return original(self)

    return read


def handed_out(node: Any) -> bool:
    """The stand-in returned ``node``, or Python arithmetic made it from such a value
    (``2 * (int(h) // 2)``): the nodes above it that hold Python numbers, up to the tensors."""
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.meta.get(_HANDED_OUT):
            return True
        value = node.meta.get("val")
        if type(value) in (_PYTHON_INT, float, bool):
            stack.extend(node.all_input_nodes)
    return False


def _rebound_code(code: types.CodeType) -> types.CodeType | None:
    """``code`` with its global ``int`` read as :data:`STAND_IN_NAME`, or None where ``int``
    is named other than as a called global (an attribute ``x.int()``, ``isinstance(x, int)``,
    a store) or the interpreter is older than 3.11 (no call form to tell it by)."""
    if sys.version_info < (3, 11) or "int" not in code.co_names:
        return None
    if STAND_IN_NAME in code.co_names:
        return None
    for instruction in dis.get_instructions(code):
        names_int = instruction.opcode in dis.hasname and instruction.argval == "int"
        if names_int and not (
            instruction.opname == "LOAD_GLOBAL" and instruction.argrepr in _CALL_LOADS
        ):
            return None
    names = tuple(STAND_IN_NAME if name == "int" else name for name in code.co_names)
    return code.replace(co_names=names)


def _functions_of(frame: types.FrameType) -> list[types.FunctionType]:
    """The function objects running ``frame``'s code: found by its qualified name from its
    module's globals (a method, a static method, a module function), else among the objects
    that refer to the code (a class made inside a function)."""
    code = frame.f_code
    qualname = getattr(code, "co_qualname", "")
    if not qualname or "<lambda>" in qualname or "comp>" in qualname or "<genexpr>" in qualname:
        return []
    if "<locals>" not in qualname:
        found: Any = frame.f_globals.get(qualname.split(".")[0])
        for part in qualname.split(".")[1:]:
            found = vars(found).get(part) if hasattr(found, "__dict__") else None
        found = getattr(found, "__func__", found)  # staticmethod, classmethod
        for _ in range(8):  # functools.wraps layers
            if isinstance(found, types.FunctionType) and found.__code__ is code:
                return [found]
            found = getattr(found, "__wrapped__", None)
    return [
        referrer
        for referrer in gc.get_referrers(code)
        if isinstance(referrer, types.FunctionType) and referrer.__code__ is code
    ]


@contextlib.contextmanager
def _code_swapped(function: types.FunctionType, code: types.CodeType) -> Iterator[None]:
    original = function.__code__
    function.__code__ = code
    try:
        yield
    finally:
        function.__code__ = original


class IntSites:
    """The int sites of this process, and which of them the current trace used.

    A site is kept for the process (its code is the same in every trace); a site whose
    traced int made a trace fail is declined for the rest of that :meth:`traced` call only,
    so every plan of a step is made the same way in every process (a stage-2 process makes
    the plans it needs itself, and the cache's code fingerprint must match them).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rebound: weakref.WeakKeyDictionary[types.FunctionType, types.CodeType] = (
            weakref.WeakKeyDictionary()
        )  # function -> its code with the stand-in
        self._seen: set[types.CodeType] = set()  # codes asked about (rebound or not)
        self._declined: set[types.CodeType] = set()  # rebound codes, this traced() call
        self._new = False
        self._used: set[types.CodeType] = set()
        self._collectors: list[set[types.CodeType]] = []  # collecting() blocks now open

    def note(self, frame: types.FrameType | None) -> bool:
        """Record the function running ``frame`` (it called ``int()`` on a traced int) as an
        int site, if it can be rebound; True if it is new (the trace must be made again)."""
        if frame is None or is_internal(frame.f_code.co_filename):
            return False
        code = frame.f_code
        with self._lock:
            if code in self._seen:
                return False
            self._seen.add(code)
            rebound = _rebound_code(code)
            functions = _functions_of(frame) if rebound is not None else []
            for function in functions:
                self._rebound[function] = rebound  # type: ignore[assignment]
                function.__globals__.setdefault(STAND_IN_NAME, traced_int)
            self._new = self._new or bool(functions)
            return bool(functions)

    def rebind(self, patcher: Patcher) -> None:
        """Run every site's function with the stand-in until ``patcher`` exits."""
        for name in ("__hash__", "__repr__"):
            patcher.patch_method(TracedValue, name, _reads_its_number(patcher, name))
        with self._lock:
            sites = [
                (function, code)
                for function, code in self._rebound.items()
                if code not in self._declined
            ]
        for function, code in sites:
            patcher.enter_context(_code_swapped(function, code))

    def traced(self, trace_once: Callable[[], _Traced]) -> _Traced:
        """``trace_once()``, made again while it finds new int sites (so the trace returned
        holds them traced) or fails having used some (made again without them)."""
        outer = self._declined, self._new, self._used  # a trace inside a trace keeps its own
        self._declined = set(outer[0])  # and those its caller declined (:meth:`declining`)
        try:
            for attempt in range(1, _MAX_TRACES + 1):
                self._new, self._used = False, set()
                try:
                    traced = trace_once()
                except Exception:
                    if attempt < _MAX_TRACES and self._used:
                        self._declined |= self._used  # without them, for this call
                        continue
                    raise
                if attempt == _MAX_TRACES or not self._new:
                    return traced
            raise AssertionError("unreachable")
        finally:
            self._declined, self._new, self._used = outer

    def used(self, code: types.CodeType) -> None:
        """The stand-in answered a traced value in ``code`` (a rebound code) this trace."""
        self._used.add(code)
        for collected in self._collectors:
            collected.add(code)

    @contextlib.contextmanager
    def collecting(self) -> Iterator[set[types.CodeType]]:
        """The (rebound) codes whose stand-in answered a traced value during the block, over
        every trace in it: the planner's analysis after a trace may refuse what they made."""
        collected: set[types.CodeType] = set()
        self._collectors.append(collected)
        try:
            yield collected
        finally:
            self._collectors.remove(collected)

    @contextlib.contextmanager
    def declining(self, codes: set[types.CodeType]) -> Iterator[None]:
        """Every trace in the block runs these (rebound) codes' functions with Python's int."""
        outer = self._declined
        self._declined = outer | codes
        try:
            yield
        finally:
            self._declined = outer


INT_SITES = IntSites()
