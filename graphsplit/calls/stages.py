"""The two stages of a module-level split, as modules holding only what each runs.

:class:`CallStage1` runs the user's step without autograd, every generator forked (caching
never moves the user's random streams), and stops it as soon as the last cached call has run:
it returns the step's inputs that cross plus the cached calls' outputs. :class:`CallStage2`
runs the user's step eagerly with those calls answered from the cache (:mod:`.holders`).

Each stage registers, under the model's own names, only the modules it runs
(:func:`skeleton`): stage 1 the modules of the cached calls, stage 2 everything else that it
computes with (not a module the step never runs, such as a VAE's decoder). The step
module itself is held as a plain attribute, so ``stage2.parameters()`` are the parameters
stage 2 uses and the weights of modules answered from the cache may stay on ``meta``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from graphsplit.calls import generators
from graphsplit.calls.analysis import version
from graphsplit.calls.call_plan import CallPlan
from graphsplit.calls.holders import StageRoutes, answers
from graphsplit.calls.module_calls import CallId, CallRouter
from graphsplit.calls.outputs import constants_differ, tensors_of
from graphsplit.calls.stopped_step import ModuleState
from graphsplit.calls.unstored_inputs.stand_in import refuse_stand_ins
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.user_lines import frame_location, user_frame


def skeleton(root: nn.Module, keep: Any, shell: nn.Module, *, own: bool) -> nn.Module:
    """A module tree mirroring ``root``'s paths that holds the submodules ``keep(path)`` picks.

    The submodules are added to ``shell`` (the stage itself). ``keep(path)`` answers True
    (hold the whole module), False (leave it out) or None (walk
    into it: its children asked in turn, and, with ``own``, its own parameters and buffers held:
    stage 2 holds those, stage 1 never does, so training never changes its fingerprint).
    """
    _hold_own(shell, root, own)
    return _fill(shell, root, "", keep, own)


def _hold_own(shell: nn.Module, module: nn.Module, own: bool) -> None:
    if own:
        for name, param in module.named_parameters(recurse=False):
            shell.register_parameter(name, param)
        for name, buffer in module.named_buffers(recurse=False):
            shell.register_buffer(name, buffer)


def _fill(shell: nn.Module, module: nn.Module, prefix: str, keep: Any, own: bool) -> nn.Module:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        decision = keep(path)
        if decision is True:
            shell.add_module(name, child)
        elif decision is None:
            inner = nn.Module()
            _hold_own(inner, child, own)
            shell.add_module(name, _fill(inner, child, f"{path}.", keep, own))
    return shell


def _above(path: str, roots: frozenset[str]) -> bool:
    return any(root.startswith(path + ".") for root in roots)


class _Stop(Exception):
    """Raised by stage 1's router after the last cached call: the rest of the step is stage 2's."""


def unseen_frozen_call(call: CallId, plan: CallPlan, watched: frozenset[str]) -> SplitError | None:
    """The refusal of an outermost frozen call stage 1 meets that no cached call of the plan
    answers and stage 2 could not run: a call of a module the example's step never called
    (``watched``: it is among the modules stage 2 does not hold), or a call beyond those the
    example made of a module answered from the cache. None for any other call.

    Why in stage 1: a sample taking a branch the example did not (a variant's encoder) would
    otherwise be cached, and stage 2, which does not hold that module, could not train from it.
    """
    path, index = call
    if path in watched:
        what = "the example batch's step never called it"
    elif path in plan.dropped and call not in plan.placeholders:
        what = f"the example batch's step made no call {index} of it"
    else:
        return None
    where, code = frame_location(user_frame())
    return user_error(  # type: ignore[return-value]
        SplitError,
        f"this sample's step makes call {index} of the frozen module {path!r}, and {what}: "
        "the module-level plan caches no such call and stage 2 does not hold it, so this "
        "sample's cache could not be trained from.",
        fix=Fix(
            "split with an example batch that takes this sample's branch (one split per "
            "variant a mixed dataset holds), or leave such samples out of this cache"
        ),
        source=f"{where}  {code}" if code else where,
    )


class CallStage1(nn.Module):
    """Stage 1: the step's crossing inputs and its cached calls' outputs, for a raw batch."""

    def __init__(
        self,
        step: nn.Module,
        plan: CallPlan,
        routed: dict[str, nn.Module],
        watched: frozenset[str] = frozenset(),
    ) -> None:
        """``routed``: the frozen modules whose calls stage 1 counts, ``watched`` among them:
        those stage 2 does not hold that the example's step never called (a call of one is
        refused, :func:`unseen_frozen_call`)."""
        super().__init__()
        held = frozenset(call[0] for call in [*plan.cached, *plan.placeholders])
        skeleton(
            step,
            lambda path: True if path in held else (None if _above(path, held) else False),
            self,
            own=False,
        )
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_routed", routed)
        object.__setattr__(self, "_watched", watched)

    @property
    def _parameters_kept(self) -> list[nn.Parameter]:
        """The step's parameters, whose ``requires_grad`` a stopped step's run must leave as
        it found them: listed once (a walk of the model on every call would cost more)."""
        kept = self.__dict__.get("_kept_parameters")
        if kept is None:
            kept = self.__dict__["_kept_parameters"] = list(self._step.parameters())
        return kept

    @property
    def code(self) -> str:
        """What this stage computes, as text (the cache fingerprint hashes it)."""
        plan: CallPlan = self._plan
        lines = [f"module-level stage 1 of {type(self._step).__name__}"]
        lines += [f"input {spec.name}: {spec.kind}" for spec in plan.inputs]
        for cached in plan.cached.values():
            module = self._routed[cached.call[0]]
            stored = [*dict.fromkeys(cached.keys.values())]  # a shared field's key once
            stored += [u.shape_key for u in cached.unread.values() if u.shape_key is not None]
            folded = f" ({cached.fold.describe()})" if cached.fold is not None else ""
            lines.append(f"call {cached.call} {type(module).__qualname__} -> {stored}{folded}")
        for call in plan.placeholders:  # run by stage 1, read only by cached calls
            lines.append(f"call {call} {type(self._routed[call[0]]).__qualname__} -> not stored")
        return "\n".join(lines)

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        plan: CallPlan = self._plan
        values = plan.bind(args, kwargs)
        crossing = {
            key: value
            for spec in plan.inputs
            if spec.name in values
            for key, value in spec.crossing(values[spec.name]).items()
        }
        # The stored inputs as the batch was given: a copy of those the step writes in place,
        # and the others' versions, to refuse a write the example's step did not make.
        unwritten = {}
        for key, value in crossing.items():
            if isinstance(value, torch.Tensor):
                if key in plan.written_inputs:
                    crossing[key] = value.detach().clone()
                else:
                    unwritten[key] = (value, version(value))
        outputs: dict[str, Any] = {}
        last = plan.last
        watched: frozenset[str] = self._watched

        def record(call: Any, module: Any, forward: Any, a: tuple, kw: dict) -> Any:
            planned = plan.cached.get(call)
            if planned is None:
                refusal = unseen_frozen_call(call, plan, watched)
                if refusal is not None:
                    raise refusal
            output = forward(*a, **kw)
            if planned is not None:
                if planned.numbers and constants_differ(output, planned.structure):
                    raise user_error(
                        SplitError,
                        f"{call[0]} call {call[1]} returned other numbers (or another structure) "
                        "than on the example batch; the module-level plan keeps them as "
                        "constants, so this sample cannot be cached.",
                        fix=Fix(
                            "return those numbers as tensors from the module, or split with "
                            "batches whose calls return the same numbers"
                        ),
                    )
                if planned.echoed:
                    _check_echoes(call, planned, output, values)
                if planned.shared:
                    _check_shared(call, planned, output)
                # A field the step goes on to write in place is kept as the call returned it.
                outputs.update(planned.crossing(output))
                if call == last:
                    raise _Stop
            return output

        if last is not None:
            router = CallRouter(self._routed, record)
            # Stopped at its last cached call, the step does not undo what it changed for a
            # while (Diffusion-DPO's disable_adapters() around the reference call).
            state = ModuleState.of(self._parameters_kept)
            try:
                with (
                    generators.forked(watch=False),
                    torch.no_grad(),
                    router.installed(),
                    contextlib.suppress(_Stop),
                ):
                    self._step(*args, **kwargs)
            finally:
                state.put_back()
            _refuse_new_writes(unwritten)
        missing = [key for key in plan.boundary if key not in outputs and key not in crossing]
        if missing:
            raise user_error(
                SplitError,
                f"this batch did not make the frozen calls the module-level plan caches "
                f"(missing {missing}).",
                fix=Fix("split with an example batch whose step makes the same frozen calls"),
            )
        return {key: crossing[key] if key in crossing else outputs[key] for key in plan.boundary}


def _refuse_new_writes(unwritten: dict[str, tuple[torch.Tensor, int | None]]) -> None:
    """Refuse a batch whose step wrote a stored input in place where, on the example batch,
    it wrote none: the value stage 1 would store is no longer the batch's."""
    written = [key for key, (tensor, before) in unwritten.items() if version(tensor) != before]
    if written:
        raise user_error(
            SplitError,
            f"the step wrote the stored input(s) {written} in place on this batch, and did not "
            "on the example batch; stage 1 stores the inputs as the batch gives them, and "
            "these are no longer what the batch gave.",
            fix=Fix(
                "split with an example batch on which the step writes its inputs as it does "
                "while training (the same train()/eval() mode and options), or copy the input "
                "before writing it (x = x.clone())"
            ),
        )


def _check_shared(call: CallId, planned: Any, output: Any) -> None:
    """Refuse a call whose fields that were one tensor on the example batch are two on this
    one: the plan stores that tensor once and answers both fields with it in stage 2."""
    tensors = tensors_of(output, planned.structure)
    for field, other in planned.shared.items():
        if tensors[field] is not tensors[other]:
            raise user_error(
                SplitError,
                f"{call[0]} call {call[1]} returned its {field} as the very tensor of its "
                f"{other} on the example batch, and a tensor of its own on this one; the "
                "module-level plan stores that tensor once and answers both fields with it.",
                fix=Fix(
                    "split with an example batch whose frozen calls return what they do "
                    "on every batch"
                ),
            )


def _check_echoes(call: CallId, planned: Any, output: Any, values: dict[str, Any]) -> None:
    """Refuse a call that returned another tensor where, on the example batch, it returned
    the step's own input: the plan answers that field with the input in stage 2."""
    tensors = tensors_of(output, planned.structure)
    for field, name in planned.echoed.items():
        if tensors[field] is not values.get(name):
            raise user_error(
                SplitError,
                f"{call[0]} call {call[1]} returned the step's input {name!r} as its {field} "
                "on the example batch, and another tensor on this one; the module-level plan "
                "answers that field with the input in stage 2, so this batch cannot be cached.",
                fix=Fix(
                    "split with an example batch whose frozen calls return what they do "
                    "on every batch"
                ),
            )


class CallStage2(nn.Module):
    """Stage 2: the user's step, run eagerly, its cached calls answered from the batch."""

    def __init__(self, step: nn.Module, plan: CallPlan, routed: dict[str, nn.Module]) -> None:
        super().__init__()
        dropped = plan.not_held
        skeleton(
            step,
            lambda path: False if path in dropped else (None if _above(path, dropped) else True),
            self,
            own=True,
        )
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_routed", routed)

    def __getstate__(self) -> dict[str, Any]:
        # The routes' answers are closures, made again on the first step after unpickling.
        return {key: value for key, value in self.__dict__.items() if key != "_routes"}

    def forward(self, **batch: Any) -> Any:
        plan: CallPlan = self._plan
        names = plan.tensor_inputs
        if names is not None:  # every input crosses as it is: no decoding
            values = {name: batch[name] for name in names if name in batch}
        else:
            values = {spec.name: spec.gather(batch) for spec in plan.inputs if spec.present(batch)}
        args, kwargs = plan.call_arguments(values)
        routes = self._routes_for_this_step()
        routes.install(batch)
        try:
            result = self._step(*args, **kwargs)
        finally:
            routes.remove()
        if names is None and plan.unstored:
            refuse_stand_ins(result)
        return result

    def _routes_for_this_step(self) -> StageRoutes:
        """The stage's routes; made again when a routed module's ``forward`` was replaced since
        (a library's hook), and made afresh for a step run inside another (not kept)."""
        routes: StageRoutes | None = self.__dict__.get("_routes")
        if routes is not None and not routes.active and routes.current():
            return routes
        made = StageRoutes(self._plan, self._routed, answers(self._plan))
        if routes is None or not routes.active:
            self.__dict__["_routes"] = made
        return made
