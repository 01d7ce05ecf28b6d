"""A new shape signature's plan, made by a split's planner after the first (reading the memos
the first plan filled, planning/meta/shared_memos.py), is exactly the plan a fresh
``graphsplit.split`` of that batch makes: every node's facts and op record, both stages' code,
the boundary, the signature; and training on it gives the fresh split's loss and gradients,
bit for bit.

Steps: DiffSynth-Studio's Wan 2.1 LoRA step (tiny, needs ``diffsynth``), a real step
``benchmarks/bench_signatures.py`` times: 7 frames, which DiffSynth rounds up to 9 (a branch on
``num_frames % 4``), get a plan of their own against 5. The frame counts DiffSynth takes as they
are (9 against 5) need none: the noise's shape is read off the cached latents
(planning/cut/number_twins.py), and the first plan's code is the code a fresh split of 9
frames makes. diffusers' FLUX full fine-tune (tests/conformance, tiny), whose unpacking's
``int(width)`` once made 32x48 images a plan of their own, now makes none
(planning/tracing/int_calls.py) either.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import graphsplit

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT
from tests.conformance.matrix import ids_and_mask
from tests.conformance.test_flux import FluxFineTuneStep
from tests.conformance.test_transformers import VOCAB


def _plan_parts(plan: Any) -> tuple:
    nodes = [
        (node.name, node.op, str(node.target), node.meta.get("facts"), node.meta.get("op_record"))
        for node in plan.graph.nodes
    ]
    return (
        nodes,
        plan.stage1.code,
        plan.stage2.code,
        dict(plan.boundary),
        plan.signature,
        plan.batch_sizes,
        plan.input_names,
        [node.name for node in plan.cut.boundary],
        sorted(node.name for node in plan.cut.stage1),
        sorted(node.name for node in plan.cut.stage2),
    )


def _trained(step: torch.nn.Module, run: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of ``run()`` under seed 7 and the trainable gradients it leaves."""
    for param in step.parameters():
        param.grad = None
    torch.manual_seed(7)
    loss = run()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in step.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_new_plan_is_the_fresh_splits(
    step: torch.nn.Module, example: dict[str, Any], other: dict[str, Any]
) -> None:
    split = graphsplit.split(step, kwargs=example)
    boundary = split.stage1(**other)  # no plan fits: the planner makes one (as cache() does)
    assert len(split.plans) == 2
    new = split.plans[1]
    fresh = graphsplit.split(step, kwargs=other)
    assert _plan_parts(new) == _plan_parts(fresh.plans[0])
    with torch.no_grad():
        fresh_boundary = fresh.stage1(**other)
    assert boundary.keys() - {"graphsplit_signature"} == fresh_boundary.keys()
    for name, value in fresh_boundary.items():
        assert torch.equal(boundary[name], value), name
    loss, grads = _trained(step, lambda: split.stage2(**boundary))
    fresh_loss, fresh_grads = _trained(step, lambda: fresh.stage2(**fresh_boundary))
    eager_loss, eager_grads = _trained(step, lambda: step(**other))
    assert torch.equal(loss, fresh_loss) and torch.equal(loss, eager_loss)
    assert grads.keys() == fresh_grads.keys() == eager_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, fresh_grads[name]), name
        assert torch.equal(grad, eager_grads[name]), name


def _flux_batch(seed: int, width: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.rand(2, 3, 32, width, generator=generator) * 2 - 1,
        "tokens_one": ids_and_mask(2, vocab=VOCAB, seed=seed)[0],
        "tokens_two": ids_and_mask(2, vocab=VOCAB, seed=seed + 50)[0],
    }


def test_flux_at_a_new_width_runs_the_first_plan_whose_code_a_fresh_split_of_it_makes():
    torch.manual_seed(0)
    step = FluxFineTuneStep(sigmas_by_index=True)  # prompts: None, as the batches carry none
    _assert_first_plan_is_the_fresh_splits(step, _flux_batch(0, 32), _flux_batch(1, 48))


def _assert_first_plan_is_the_fresh_splits(
    step: torch.nn.Module, example: dict[str, Any], other: dict[str, Any]
) -> None:
    split = graphsplit.split(step, kwargs=example)
    boundary = split.stage1(**other)
    assert len(split.plans) == 1 and "graphsplit_signature" not in boundary
    fresh = graphsplit.split(step, kwargs=other)
    assert split.stage1.code == fresh.stage1.code and split.stage2.code == fresh.stage2.code
    assert [(spec.name, spec.batch_dim) for spec in split.boundary.values()] == [
        (spec.name, spec.batch_dim) for spec in fresh.boundary.values()
    ]  # their example shapes are the examples'
    assert split.plans[0].signature == fresh.plans[0].signature
    with torch.no_grad():
        fresh_boundary = fresh.stage1(**other)
    assert boundary.keys() == fresh_boundary.keys()
    for name, value in fresh_boundary.items():
        assert torch.equal(boundary[name], value), name
    loss, grads = _trained(step, lambda: split.stage2(**boundary))
    eager_loss, eager_grads = _trained(step, lambda: step(**other))
    assert torch.equal(loss, eager_loss)
    assert grads.keys() == eager_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, eager_grads[name]), name


def _clip(seed: int, frames: int) -> dict[str, torch.Tensor]:
    from examples.diffsynth.steps import wan_batch

    batch = wan_batch(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    batch["video"] = torch.rand(1, 3, frames, 32, 32, generator=generator) * 2 - 1
    return batch


@pytest.mark.skipif(not DIFFSYNTH, reason=WHY_NOT)
def test_wan_plan_for_a_frame_count_it_rounds_is_the_plan_a_fresh_split_makes():
    from examples.diffsynth.steps import wan_t2v_lora_step

    step, _ = wan_t2v_lora_step(seed=0)
    _assert_new_plan_is_the_fresh_splits(step, _clip(0, 5), _clip(1, 7))  # rounded up to 9


@pytest.mark.skipif(not DIFFSYNTH, reason=WHY_NOT)
def test_wan_at_a_new_frame_count_runs_the_first_plan_whose_code_a_fresh_split_of_it_makes():
    from examples.diffsynth.steps import wan_t2v_lora_step

    step, _ = wan_t2v_lora_step(seed=0)
    _assert_first_plan_is_the_fresh_splits(step, _clip(0, 5), _clip(1, 9))


if not DIFFSYNTH:
    print(f"{__name__}: the Wan case is skipped: {WHY_NOT}", file=sys.stderr)
