"""One plan per shape signature, made when a batch first needs it, and the stages that dispatch.

A plan holds Python constants the trace derived from sizes or read from frozen data, each
rechecked at run time (:mod:`graphsplit.runtime`). A batch that breaks such a check raises the
typed signal :class:`~graphsplit.runtime.PlanMismatch`; :class:`PlanSet` answers it as
torch.compile answers a guard failure: it tries the plans it has, and when none fits it calls
the planner again with that batch as the example (within ``max_plans``). Sizes that merely flow
through torch ops (``int()`` of them included, planning/tracing/int_calls.py) stay symbolic:
they never make a plan.

Glossary:
    plan: the stages, boundary, graph and cut one run of the planner produced
        (:class:`Plan`), with its :class:`~graphsplit.signatures.signature.Signature`.
    first plan: the one ``graphsplit.split`` made from the user's example. ``split.stage1`` and
        ``split.stage2`` *are* its GraphModules (same code, attributes, state dict); their
        ``forward`` is replaced on the instance by the dispatcher, which runs the first plan's
        generated code unchanged while one plan serves every batch.
    stage-1 dispatch: try the plans (the last one used first); a check that fails raises before
        the frozen work where it reads input sizes only (stage 1 hoists those checks), after it
        where it reads a value computed by frozen work. Then the plan's stage-2 checks of
        boundary sizes run on stage 1's outputs (:mod:`~graphsplit.signatures.boundary_checks`):
        a batch stage 2 would refuse is refused here, before a row of it is cached. No plan
        fits: make one.
    stage-2 dispatch: a batch that names its plan (:data:`SIGNATURE_KEY`, put there by stage 1
        once there are several plans and by the cache's collate) runs that plan, built from the
        example the cache recorded if this process never made it. A batch that names none is
        tried on each plan, the random generators restored after a plan that refused it, so a
        draw made before the refusing check is drawn again by the right plan, exactly.

In and out::

    PlanSet(first, make_plan, max_plans).install()        # split.stage1 / stage2 dispatch
    plans.run_stage1_signed(*args, **kwargs) -> (outputs, Plan)    # what cache() calls
    plans.know(key, signature_json, example_json)          # a plan a cache recorded
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphsplit.artifacts import BoundarySpec, Cut
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.random_draws import generator_states, set_generator_states
from graphsplit.runtime import PlanMismatch, check_same_read
from graphsplit.signatures.boundary_checks import SizeChecks
from graphsplit.signatures.names import short_name
from graphsplit.signatures.signature import (
    SIGNATURE_KEY,
    Signature,
    example_from_record,
)

__all__ = ["DEFAULT_MAX_PLANS", "Plan", "PlanSet"]

DEFAULT_MAX_PLANS = 8

MAX_PLANS_FIX = Fix(
    "pass a larger max_plans to graphsplit.split (each plan costs about one split; "
    "docs/benchmarks.md measures it), or bucket the data so that fewer of these values "
    "reach the step, or keep the size inside tensor ops (x.view(x.shape[0], -1)) so that "
    "it stays symbolic"
)
NO_STAGE2_PLAN_FIX = Fix(
    "run split.stage1 on a raw batch of this signature first (graphsplit.cache does), or "
    "read the batches from CachedDataset(path, split).loader(...), whose batches name "
    "their plan and whose cache records each plan's example"
)

# Two different plans whose signatures are equal (_new_plan): nothing the user did.
SAME_KEY_FIX = Fix(
    "report it with the step and the two batches' shapes; meanwhile split with an example "
    "of this batch's shape and cache its batches apart (graphsplit.split(step, batch))"
)

# A cache's plan that this split plans differently (dispatch's _plan_for).
STALE_PLAN_FIX = Fix(
    "write the cache again with this graphsplit and step: graphsplit.cache(split, loader, "
    "path, overwrite=True); or read it where the graphsplit and step that wrote it are installed"
)


@dataclass
class Plan:
    """What one run of the planner made, for one signature."""

    stage1: fx.GraphModule
    stage2: fx.GraphModule
    boundary: dict[str, BoundarySpec]
    input_names: tuple[str, ...]
    graph: fx.Graph = field(repr=False)
    cut: Cut = field(repr=False)
    batch_sizes: tuple[int, int]
    notes: list[str]
    signature: Signature
    example: str | None  # example_record() of the batch it was made from
    seconds: float  # what making it cost
    # Inputs the example did not give, traced as forward's default (signatures/defaults.py).
    defaulted: dict[str, Any] = field(default_factory=dict)
    # Leaves kept whole because tracing into them failed (artifacts.Traced.kept_whole).
    kept_whole: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return self.signature.key


def _raw_forward(stage: fx.GraphModule) -> Callable[..., Any]:
    """The stage's generated ``forward``, never the dispatcher installed on the instance."""
    return types.MethodType(type(stage).forward, stage)


def _rng_states() -> dict[str, Any]:
    states = generator_states()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    set_generator_states(states)
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


ONE_SAMPLE_STAGE2_FIX = Fix(
    "read the cache one sample per batch: CachedDataset(path, split).loader(batch_size=1) "
    "(accumulate gradients over several batches for a larger effective batch)"
)


def _refuse_several_samples(plan: Plan, batch: dict[str, Any]) -> None:
    """A plan made one sample per batch (``batch_sizes == (1, 1)``) trains one sample per
    batch: a stage-2 batch of several would break a size check deep in the user's code, or
    compute something else. A plan holding a value read off a batch of several samples
    (``[v] * B``: each sample reads v) trains batches of B samples only."""
    if plan.batch_sizes != (1, 1):
        if plan.signature.reads_values:
            _refuse_other_batch_size(plan, batch, plan.batch_sizes[0])
        return
    for name, spec in plan.boundary.items():
        value = batch.get(name)
        if spec.batch_dim is None or not isinstance(value, torch.Tensor):
            continue
        if value.dim() > spec.batch_dim and value.shape[spec.batch_dim] != 1:
            raise user_error(
                SplitError,
                f"stage 2 got {value.shape[spec.batch_dim]} samples in {name!r} (shape "
                f"{tuple(value.shape)}), but this plan runs one sample per batch: the step "
                "only ran at batch size 1 when it was split.",
                fix=ONE_SAMPLE_STAGE2_FIX,
            )


OTHER_AUTOCAST_FIX = Fix(
    "run graphsplit.split, graphsplit.cache and training under the same autocast (all inside "
    "`with accelerator.autocast():` or `with torch.autocast(...)`), or all without one"
)


def _refuse_other_dtypes(plan: Plan, outputs: Any) -> None:
    """Stage 1 made a boundary tensor in another dtype than the plan holds: it runs under
    another autocast than ``split()`` saw (split outside ``accelerator.autocast()``, cached
    inside it). The cache would store the rows cast to the plan's dtype, and stage 2 would
    compute in a dtype the unsplit step, run as stage 1 ran, never saw: refused."""
    if not isinstance(outputs, dict):
        return
    for name, spec in plan.boundary.items():
        value = outputs.get(name)
        if isinstance(value, torch.Tensor) and value.dtype != spec.dtype:
            raise user_error(
                SplitError,
                f"stage 1 made the boundary tensor {name!r} in {value.dtype}, where "
                f"graphsplit.split planned {spec.dtype}: stage 1 runs under another autocast "
                "than split() ran under, and stage 2 would compute in dtypes the step never "
                "had.",
                fix=OTHER_AUTOCAST_FIX,
                source=spec.source,
            )


def _refuse_other_batch_size(plan: Plan, batch: dict[str, Any], size: int) -> None:
    for name, spec in plan.boundary.items():
        value = batch.get(name)
        if spec.batch_dim is None or not isinstance(value, torch.Tensor):
            continue
        if value.dim() > spec.batch_dim and value.shape[spec.batch_dim] != size:
            raise user_error(
                SplitError,
                f"stage 2 got {value.shape[spec.batch_dim]} samples in {name!r}, but this plan "
                f"holds a value read off frozen data for a batch of {size} samples "
                f"({short_name(plan.signature, example=plan.example)}); its code was traced "
                f"for {size} samples.",
                fix=Fix(
                    f"read the cache in batches of {size}: CachedDataset(path, split).loader("
                    f"batch_size={size}, drop_last=True)"
                ),
            )


class PlanSet:
    """The plans of one split, by signature key, and the dispatch between them."""

    def __init__(
        self,
        first: Plan,
        make_plan: Callable[[tuple[Any, ...], dict[str, Any]], Plan],
        max_plans: int = DEFAULT_MAX_PLANS,
    ) -> None:
        if type(max_plans) is not int or max_plans < 1:
            raise ValueError(f"max_plans must be a positive integer, got {max_plans!r}")
        self.first = first
        self.plans: dict[str, Plan] = {first.key: first}
        self.max_plans = max_plans
        self._make_plan = make_plan
        self._recent: list[str] = [first.key]  # the last plan used first
        # Plans a cache recorded and this process has not made: key -> (signature, example).
        self.recorded: dict[str, tuple[str, str | None]] = {}
        # Per plan key: stage 2's checks of boundary sizes, cut out once (None: it has none).
        self._size_checks: dict[str, SizeChecks | None] = {}
        self._late: dict[str, bool] = {}  # per plan key: see _refuses_late

    # -- wiring --------------------------------------------------------------------------------
    def install(self) -> None:
        """Make the first plan's GraphModules dispatch (see the module glossary)."""
        self.first.stage1.forward = _Dispatching(self, "run_stage1")  # type: ignore[method-assign]
        self.first.stage2.forward = _Dispatching(self, "run_stage2")  # type: ignore[method-assign]

    def know(self, key: str, signature: str, example: str | None) -> None:
        """Remember a plan a cache recorded, to build it when a stage-2 batch names it."""
        if key not in self.plans:
            self.recorded[key] = (signature, example)

    # -- stage 1 -------------------------------------------------------------------------------
    def run_stage1(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Stage 1 of the batch's plan; names the plan in the outputs once there are several."""
        outputs, plan = self.run_stage1_signed(*args, **kwargs)
        if len(self.plans) > 1 or self.recorded:
            outputs = {**outputs, SIGNATURE_KEY: plan.key}
        return outputs

    def run_stage1_signed(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], Plan]:
        """Stage 1's outputs for this batch, and the plan that made them (made if needed)."""
        refusals: list[PlanMismatch] = []
        for plan in sorted(self._by_recency(), key=self._refuses_late):
            try:
                outputs = self._checked_stage1(plan, args, kwargs)
            except PlanMismatch as refusal:
                refusals.append(refusal)
                continue
            self._used(plan)
            return outputs, plan
        plan = self._new_plan(args, kwargs, refusals[0])
        outputs = self._checked_stage1(plan, args, kwargs)
        self._used(plan)
        return outputs, plan

    def _refuses_late(self, plan: Plan) -> bool:
        """Whether the plan's stage 1 may refuse a batch only after its frozen work: a check of
        a size stage 2 reads off a cached tensor needs that tensor. Stage 1 tries such plans
        last, so that a batch another plan takes runs the frozen work once."""
        if plan.key not in self._late:
            nodes = plan.stage1.graph.nodes
            self._late[plan.key] = any(node.target is check_same_read for node in nodes)
        return self._late[plan.key]

    def _checked_stage1(
        self, plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """The plan's stage 1, then its stage 2's checks of the boundary sizes it made."""
        outputs = _raw_forward(plan.stage1)(*args, **kwargs)
        _refuse_other_dtypes(plan, outputs)
        if plan.key not in self._size_checks:
            self._size_checks[plan.key] = SizeChecks.of(plan.stage2)
        checks = self._size_checks[plan.key]
        if checks is not None and isinstance(outputs, dict):
            checks.run(outputs)
        return outputs

    def _new_plan(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], refusal: PlanMismatch
    ) -> Plan:
        if len(self.plans) >= self.max_plans:
            raise self._budget_error(refusal)
        # cache() runs stage 1 under inference_mode; the planner needs the modes split() had.
        with torch.inference_mode(False), torch.enable_grad():
            plan = self._make_plan(args, kwargs)
        if plan.key in self.plans:
            # Every plan refused the batch, so the new one differs from them: the same key
            # would send batches of one to the other's stage 2.
            raise user_error(
                SplitError,
                f"the plan made for this batch has the signature key {plan.key!r} of a plan "
                f"that refused the batch ({refusal.reason.split(';')[0]}): their signatures do "
                "not tell them apart, and a batch naming that key could train on the wrong "
                "one. This is a graphsplit bug.",
                fix=SAME_KEY_FIX,
                source=refusal.difference.where if refusal.difference else None,
            )
        self.plans[plan.key] = plan
        self.recorded.pop(plan.key, None)
        return plan

    def _budget_error(self, refusal: PlanMismatch) -> SplitError:
        difference = refusal.difference
        assert difference is not None, "every PlanMismatch carries its difference"
        varying = self.varying()
        varying.setdefault(difference.what, difference.where)
        sizes = "; ".join(f"{what} (at {where})" for what, where in varying.items())
        made = "; ".join(self.name(plan) for plan in self.plans.values())
        what_differed = refusal.reason.removesuffix("; split again for this size.")
        return user_error(
            SplitError,
            f"{what_differed.rstrip('.')}: the batch needs a plan of its own, and "
            f"graphsplit.split has made max_plans={self.max_plans} plan(s) already ({made}). "
            f"The values that vary between batches: {sizes}.",
            fix=MAX_PLANS_FIX,
            source=difference.where,
        )

    def name(self, plan: Plan) -> str:
        """The plan's signature in a few words: the checks that differ between the plans
        (:mod:`~graphsplit.signatures.names`)."""
        return short_name(plan.signature, self.varying(), plan.example)

    def varying(self) -> dict[str, str]:
        """``what -> user's line`` of each checked value whose expected value differs between
        the plans (or that some plans do not check)."""
        seen: dict[str, set[str]] = {}
        lines: dict[str, str] = {}
        for plan in self.plans.values():
            values = dict(plan.signature.values)
            lines.update(plan.signature.lines)
            for what in {what for p in self.plans.values() for what, _ in p.signature.values}:
                seen.setdefault(what, set()).add(values.get(what, "<unchecked>"))
        return {what: lines.get(what, "?") for what, values in seen.items() if len(values) > 1}

    # -- stage 2 -------------------------------------------------------------------------------
    def run_stage2(self, **batch: Any) -> Any:
        """Stage 2 of the plan the batch names, or of the one whose checks it passes."""
        key = batch.pop(SIGNATURE_KEY, None)
        if key is not None:
            plan = self._plan_for(key)
            _refuse_several_samples(plan, batch)
            self._used(plan)
            return _raw_forward(plan.stage2)(**batch)
        _refuse_several_samples(self.first, batch)
        if len(self.plans) == 1 and not self.recorded:  # the one-signature step, as ever
            try:
                return _raw_forward(self.first.stage2)(**batch)
            except PlanMismatch as refusal:
                if len(self.plans) >= self.max_plans:
                    raise self._budget_error(refusal) from None
                raise self._no_plan_error([refusal]) from None
        return self._tried_in_turn(batch)

    def _tried_in_turn(self, batch: dict[str, Any]) -> Any:
        # The first plan first: a batch graphsplit made names no plan only where the first
        # plan was the only one (a cache of it alone, stage 1's outputs before a second plan).
        ordered = [self.first] + [p for p in self._by_recency() if p is not self.first]
        candidates = [p for p in ordered if not p.signature.reads_values]
        refusals: list[PlanMismatch] = []
        for plan in candidates:
            states = _rng_states()
            try:
                result = _raw_forward(plan.stage2)(**batch)
            except PlanMismatch as refusal:
                _set_rng_states(states)  # the right plan draws what this one drew
                refusals.append(refusal)
                continue
            self._used(plan)
            return result
        raise self._no_plan_error(refusals)

    def _no_plan_error(self, refusals: list[PlanMismatch]) -> SplitError:
        reason = (
            f"stage 2 got a batch that none of the {len(self.plans)} plan(s) fits"
            + (f" ({refusals[0].reason.split(';')[0]})" if refusals else "")
            + " and that names no plan; stage 2 cannot make a plan from boundary values."
        )
        where = refusals[0].difference.where if refusals and refusals[0].difference else None
        return user_error(SplitError, reason, fix=NO_STAGE2_PLAN_FIX, source=where)

    def _plan_for(self, key: str) -> Plan:
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        if key not in self.recorded:
            raise user_error(
                SplitError,
                f"the batch names the plan {key!r}, which this split neither made nor knows "
                "from a cache.",
                fix=NO_STAGE2_PLAN_FIX,
            )
        signature, example = self.recorded[key]
        if example is None or Signature.from_json(signature).reads_values:
            raise user_error(
                SplitError,
                f"the batch names the plan {key!r} "
                f"({short_name(Signature.from_json(signature), self.varying())}), which "
                "this process has not made, and the cache's record of it cannot rebuild it "
                "(it reads a value from frozen data, or its example held values JSON cannot "
                "hold).",
                fix=NO_STAGE2_PLAN_FIX,
            )
        args, kwargs = example_from_record(example)
        with torch.inference_mode(False), torch.enable_grad():
            plan = self._make_plan(args, kwargs)
        if plan.key != key:
            raise user_error(
                SplitError,
                f"rebuilding the plan {key!r} from the cache's example made another plan "
                f"({plan.key}: {self.name(plan)}): the cache was written by another version "
                "of graphsplit or of the step, which planned that example differently.",
                fix=STALE_PLAN_FIX,
            )
        self.plans[key] = plan
        del self.recorded[key]
        return plan

    # -- order ---------------------------------------------------------------------------------
    def _by_recency(self) -> list[Plan]:
        return [self.plans[key] for key in self._recent]

    def _used(self, plan: Plan) -> None:
        if self._recent[0] != plan.key:
            self._recent = [plan.key] + [key for key in self._recent if key != plan.key]


class _Dispatching:
    """A :class:`PlanSet` method (``run_stage1`` / ``run_stage2``) as a callable object, to
    stand as a stage's ``forward``. Not a bound method: accelerate's ``prepare_model``, with
    mixed precision on, wraps ``forward.__func__`` in its autocast and binds it to the module
    again (``MethodType(autocast(func), model)``), so a bound method of the PlanSet ran with
    the GraphModule as ``self`` (``'Stage2' object has no attribute 'first'``); an object has
    no ``__func__``, and accelerate wraps it as it is. Not a closure either: a deep copy of the
    stage (an EMA copy) must copy the PlanSet it dispatches through, as it copies this."""

    __slots__ = ("name", "plans")

    def __init__(self, plans: PlanSet, name: str) -> None:
        self.plans = plans
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.plans, self.name)(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(getattr(self.plans, self.name))

    @property
    def __code__(self) -> types.CodeType:
        # torch.compile(stage) files the GraphModule under ``forward.__code__`` (a bound
        # method answers its function's): the dispatcher method's code, as before.
        return getattr(type(self.plans), self.name).__code__

    @property
    def __name__(self) -> str:
        return self.name
