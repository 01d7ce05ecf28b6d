"""What the step changed in its modules when stage 1 stopped it: put back.

Stage 1 of the module-level path runs the user's step up to its last cached call and stops it
there (:class:`graphsplit.calls.stages.CallStage1`): the rest of the step, the trainable work,
never runs. The Python the step ran before the stop did, and it may have changed its modules
for a while: diffusers' Diffusion-DPO script gets its reference prediction with
``unet.disable_adapters()``, the UNet's call, then ``unet.enable_adapters()``. Stopped at a
frozen call inside the reference prediction, the step never re-enables the adapters, and every
later step (stage 2, the unsplit step in ``verify``) would run the policy as the reference,
with the LoRA's parameters no longer requiring grad (peft's ``enable_adapters(False)`` turns
them off).

So while stage 1 runs, the writes its thread makes into modules are followed
(``nn.Module.__setattr__`` / ``__delattr__``: peft's ``_disable_adapters``, ``training``, a
user's flag, a parameter, buffer or submodule replaced), and after the stop each written
attribute gets back the value it held before the first write, in the slot it held it in; and
each parameter's ``requires_grad`` comes back as it was. Values written *into* tensors (a
buffer updated in place) are not state this undoes: stage 1 runs under ``no_grad``, and the
probes refuse a cached call that mutates its inputs or its module's buffers.

Cost: the module class's attribute writes go through one more Python function (once
installed, for the process: a look-up of this thread's record, nothing recorded outside
stage 1), a record per attribute the step writes, and one pass over the parameters' flags a
stage-1 call (``benchmarks/bench_stage1_state.py``), where a copy of every module's dicts
on every call would cost in proportion to the model's module count.

    state = ModuleState.of(parameters)      # follows this thread's module writes from here
    ... run the step, stopped early ...
    state.put_back()
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["ModuleState"]

_HELD = ("_parameters", "_buffers", "_modules")
_MISSING = object()
_RECORDS = threading.local()
_INSTALL = threading.Lock()
_ORIGINALS: dict[str, Any] = {}


class ModuleState:
    """This thread's module writes since :meth:`of`, and the parameters' ``requires_grad``."""

    def __init__(self, flags: list[tuple[nn.Parameter, bool]]) -> None:
        self.flags = flags
        self.before: dict[tuple[int, str], tuple[nn.Module, str, str, Any]] = {}
        self._outer: ModuleState | None = None

    @classmethod
    def of(cls, parameters: Sequence[nn.Parameter]) -> ModuleState:
        """Start following this thread's module writes (``parameters``: whose flags to keep;
        a stage takes them once, a walk of the model on every call would cost more)."""
        _install()
        state = cls([(param, param.requires_grad) for param in parameters])
        state._outer = getattr(_RECORDS, "state", None)  # a stage 1 run inside another's step
        _RECORDS.state = state
        return state

    def note(self, module: nn.Module, name: str) -> None:
        key = (id(module), name)
        if key not in self.before:
            self.before[key] = (module, name, *_slot(module, name))

    def put_back(self) -> None:
        """Stop following; every written attribute and flag as :meth:`of` found it."""
        _RECORDS.state = self._outer
        for module, name, where, value in reversed(list(self.before.values())):
            attributes = module.__dict__
            attributes.pop(name, None)
            for held in _HELD:
                attributes[held].pop(name, None)
            if value is not _MISSING:
                (attributes if where == "__dict__" else attributes[where])[name] = value
        if self._outer is not None:  # the outer run's record covers these writes too
            for key, entry in self.before.items():
                self._outer.before.setdefault(key, entry)
        for param, flag in self.flags:
            if param.requires_grad != flag:
                param.requires_grad_(flag)


def _slot(module: nn.Module, name: str) -> tuple[str, Any]:
    """Where ``module`` holds ``name`` now (its ``__dict__`` or a table of held tensors and
    submodules) and its value there."""
    attributes = module.__dict__
    for held in _HELD:
        table = attributes.get(held)
        if table is not None and name in table:
            return held, table[name]
    return "__dict__", attributes.get(name, _MISSING)


def _install() -> None:
    """Route ``nn.Module``'s attribute writes through the recorder, and leave it there (a
    wrapper put back after each run would undo another thread's patch installed meanwhile);
    installed again over whatever replaced it since (a patch of another thread put back)."""
    with _INSTALL:
        if nn.Module.__setattr__ is _ORIGINALS.get("ours"):
            return
        setattr_ = nn.Module.__setattr__
        delattr_ = nn.Module.__delattr__

        def __setattr__(module: nn.Module, name: str, value: Any) -> None:
            state = getattr(_RECORDS, "state", None)
            if state is not None:
                state.note(module, name)
            setattr_(module, name, value)

        def __delattr__(module: nn.Module, name: str) -> None:
            state = getattr(_RECORDS, "state", None)
            if state is not None:
                state.note(module, name)
            delattr_(module, name)

        nn.Module.__setattr__ = __setattr__  # type: ignore[method-assign]
        nn.Module.__delattr__ = __delattr__  # type: ignore[method-assign]
        _ORIGINALS["ours"] = __setattr__
