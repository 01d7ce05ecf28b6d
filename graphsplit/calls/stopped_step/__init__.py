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

So stage 1 takes the modules' state before it runs the step (:func:`ModuleState.of`), and puts
it back after a stop (:meth:`ModuleState.put_back`): every module's attributes (its instance
``__dict__``: peft's ``_disable_adapters``, ``training``, a user's flag), the parameters,
buffers and submodules it holds, and each parameter's ``requires_grad``. Values the step wrote
*into* tensors (a buffer updated in place) are not state this undoes: stage 1 runs under
``no_grad`` and the probes refuse a cached call that mutates its inputs or buffers.

Cost: one shallow copy of each module's dicts a stage-1 call (a few microseconds a module;
milliseconds for a model of thousands of modules, beside stage 1's seconds of work).

    state = ModuleState.of(root)
    ... run the step, stopped early ...
    state.put_back()
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["ModuleState"]

_HELD = ("_parameters", "_buffers", "_modules")


@dataclass
class ModuleState:
    """The modules' attributes, held tensors and submodules, and ``requires_grad`` flags."""

    saved: list[tuple[nn.Module, dict, tuple[dict, ...]]]
    flags: list[tuple[nn.Parameter, bool]]

    @classmethod
    def of(cls, root: nn.Module) -> ModuleState:
        saved = [
            (module, dict(module.__dict__), tuple(dict(module.__dict__[n]) for n in _HELD))
            for module in root.modules()
        ]
        flags = [(param, param.requires_grad) for param in root.parameters()]
        return cls(saved, flags)

    def put_back(self) -> None:
        """Every module's state as :meth:`of` found it (only what changed is written)."""
        for module, attributes, held in self.saved:
            _put_back(module.__dict__, attributes)
            for name, before in zip(_HELD, held):
                current = attributes[name]  # the dict object itself is the one taken
                module.__dict__[name] = current
                _put_back(current, before)
        for param, flag in self.flags:
            if param.requires_grad != flag:
                param.requires_grad_(flag)


def _put_back(current: dict, before: dict) -> None:
    for key in [key for key in current if key not in before]:
        del current[key]
    for key, value in before.items():
        if key not in current or current[key] is not value:
            current[key] = value
