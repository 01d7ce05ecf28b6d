"""Every traced ``checkpoint(fn, ...)`` is one checkpoint call in stage 2 (issue 11, item 5).

A ``fn`` that runs several modules and ops, a ``functools.partial``, a checkpoint with a
selective ``context_fn``, the trainable remainder of a region stage 1 partly caches, and a
transformers layer traced into (its own ``gradient_checkpointing_enable()``) are outlined into
a region module that stage 2 calls through ``torch.utils.checkpoint.checkpoint`` with the
step's options. Each test checks losses and gradients bit for bit against the unsplit step
(:func:`split_and_verify`), counts the checkpoint calls of stage 2 against eager's, and counts
the tensors autograd saves against a run without checkpointing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as checkpoint_taken_early

import graphsplit
from graphsplit.planning.rules.outline import outline
from tests.helpers import batch, frozen, split_and_verify
from tests.planning.test_checkpoint import Block

ARGS = (batch(2, 5, 8), batch(2, 5, 8, seed=1))


@contextlib.contextmanager
def counted_checkpoints() -> Iterator[list[str]]:
    """Count the checkpoints torch runs, however ``checkpoint`` was reached.

    transformers' layers call a ``functools.partial(checkpoint, ...)`` made before the step
    runs, so replacing ``torch.utils.checkpoint.checkpoint`` would miss them; torch's
    ``checkpoint`` looks its two engines up on each call, and those are counted instead.
    """
    module = torch.utils.checkpoint
    generator, function_class = (
        module._checkpoint_without_reentrant_generator,
        module.CheckpointFunction,
    )
    calls: list[str] = []

    def without_reentrant(*args, **kwargs):
        calls.append("use_reentrant=False")
        return generator(*args, **kwargs)

    class Reentrant:
        @staticmethod
        def apply(*args):
            calls.append("use_reentrant=True")
            return function_class.apply(*args)

    module._checkpoint_without_reentrant_generator, module.CheckpointFunction = (
        without_reentrant,
        Reentrant,
    )
    try:
        yield calls
    finally:
        module._checkpoint_without_reentrant_generator = generator
        module.CheckpointFunction = function_class


def checkpoint_calls(run) -> int:
    with counted_checkpoints() as calls:
        run()
    return len(calls)


def activations_saved(run, inputs) -> int:
    """Tensors autograd keeps for backward while ``run()`` executes its forward, leaving out
    the ones that are (views of) ``inputs``: those are held anyway, and a checkpoint saves its
    inputs, which differ between the step (closures) and stage 2 (explicit inputs)."""
    return len(_saved_storages(run, inputs)[0])


def activation_bytes(run, inputs) -> int:
    """Bytes of the distinct storages autograd holds for backward at the end of ``run()``'s
    forward (inputs left out, as above): the activation memory checkpointing exists to cut,
    and what a peak-memory reading of the step's forward would add over its weights."""
    return sum(_saved_storages(run, inputs)[1].values())


def _saved_storages(run, inputs) -> tuple[list[int], dict[int, int]]:
    held = {tensor.untyped_storage().data_ptr() for tensor in inputs}
    saved: list[int] = []
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            saved.append(storage.data_ptr())
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return saved, storages


def assert_checkpointed_as_eager(model, plain, args, *, regions: int, exact_saved: bool = True):
    """Split ``model`` (exact), then: stage 2 makes eager's checkpoint calls, and keeps no more
    activations for backward than eager does, fewer than ``plain`` (the same step without
    checkpointing; with ``exact_saved``, as many as eager)."""
    split = split_and_verify(model, args)
    boundary = split.stage1(*args)
    assert checkpoint_calls(lambda: split.stage2(**boundary)) == regions
    assert checkpoint_calls(lambda: model(*args)) == regions
    plain.load_state_dict(model.state_dict())
    stage2_saved = activations_saved(lambda: split.stage2(**boundary), boundary.values())
    eager_saved = activations_saved(lambda: model(*args), args)
    # Counted, not weighed, stage 2 may save more: a constant it computes itself (a LoRA Llama's
    # rotary cos / sin, recomputed rather than cached) is saved where the cached one, an input,
    # was left out of the count. The bytes below are the memory checkpointing must cut.
    assert eager_saved < activations_saved(lambda: plain(*args), args)
    stage2_bytes = activation_bytes(lambda: split.stage2(**boundary), boundary.values())
    eager_bytes = activation_bytes(lambda: model(*args), args)
    assert stage2_bytes <= eager_bytes < activation_bytes(lambda: plain(*args), args)
    if exact_saved:
        assert stage2_saved == eager_saved
        assert stage2_bytes == eager_bytes
    assert_trains_from_a_cache(model, split, args)
    return split


def assert_trains_from_a_cache(model, split, args) -> None:
    """Stage 2 fed the boundary as a cache gives it (loaded from disk: no tensor requires
    grad, whatever stage 1's hooks did) gives the step's gradients, bit for bit."""
    expected = _gradients_after_step(model, lambda: model(*args))
    with torch.no_grad():
        boundary = split.stage1(*args)
    cached = {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for key, value in boundary.items()
    }
    got = _gradients_after_step(model, lambda: split.stage2(**cached))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


class MultiOpRegion(nn.Module):
    """``custom_forward`` runs two blocks, an op between them and a noise draw."""

    def __init__(self, checkpointing: bool = True, taken_early: bool = False, **options) -> None:
        super().__init__()
        # ``from torch.utils.checkpoint import checkpoint`` (as transformers holds it) or the
        # attribute looked up at call time (as DiffSynth and diffusers call it).
        self.taken_early = taken_early
        self.text_encoder = frozen(nn.Linear(8, 8))
        self.project = nn.Linear(8, 8)  # the reentrant engine needs an input requiring grad
        self.block1, self.block2 = Block(), Block()
        self.checkpointing = checkpointing
        self.options = {"use_reentrant": False, **options}

    def forward(self, latents, prompt):
        context = self.text_encoder(prompt)
        hidden = self.project(latents)

        def custom_forward(x):
            x = x + 0.1 * torch.randn_like(x)
            return self.block2(torch.relu(self.block1(x, context)), context)

        if self.checkpointing:
            checkpoint = (
                checkpoint_taken_early if self.taken_early else torch.utils.checkpoint.checkpoint
            )
            hidden = checkpoint(custom_forward, hidden, **self.options)
        else:
            hidden = custom_forward(hidden)
        return hidden.square().mean()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_function_of_several_modules_and_ops_is_one_checkpoint_call(use_reentrant):
    model = MultiOpRegion(use_reentrant=use_reentrant)
    split = assert_checkpointed_as_eager(model, MultiOpRegion(checkpointing=False), ARGS, regions=1)
    call = "reentrant_checkpoint(" if use_reentrant else "torch.utils.checkpoint.checkpoint("
    assert split.stage2.code.count(f"{call}checkpointed_0") == 1
    assert f"use_reentrant = {use_reentrant}" in split.stage2.code
    region = split.stage2.checkpointed_0
    assert "self.block1(" in region.code and "torch.relu(" in region.code
    assert "self.block2(" in region.code and "torch.randn_like(" in region.code
    # The region shares the stage's modules: nothing of its own, nothing held twice.
    assert region.block1 is model.block1 and region.block2 is model.block2
    assert not list(region.parameters()) and not list(region.buffers())
    assert set(split.stage2.state_dict()) == set(model.state_dict()) - {
        "text_encoder.weight",
        "text_encoder.bias",
    }


def _gradients_after_step(module: nn.Module, run) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    run().backward()
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preserve_rng_state", [True, False])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_random_ops_in_a_region_draw_the_same_numbers_when_recomputed(
    use_reentrant, preserve_rng_state
):
    """With ``preserve_rng_state`` (torch's default), backward recomputes the dropout masks
    and the noise the forward drew: the gradients are those of the step run without any
    checkpointing. Without it the recomputation draws new numbers: stage 2 still matches the
    step (it runs the same program), but no longer the one without checkpointing."""
    plain = MultiOpRegion(checkpointing=False)
    expected = _gradients_after_step(plain, lambda: plain(*ARGS))
    model = MultiOpRegion(use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)
    model.load_state_dict(plain.state_dict())
    split = split_and_verify(model, ARGS)
    if not preserve_rng_state:
        assert "preserve_rng_state = False" in split.stage2.code
    boundary = split.stage1(*ARGS)
    got = _gradients_after_step(model, lambda: split.stage2(**boundary))
    assert got.keys() == expected.keys()
    same = all(torch.equal(got[name], expected[name]) for name in expected)
    assert same is preserve_rng_state


class GatedLoop(nn.Module):
    """A loop of checkpointed functions that each return two values the step uses after."""

    def __init__(self, checkpointing: bool = True, use_reentrant: bool = False) -> None:
        super().__init__()
        self.text_encoder = frozen(nn.Linear(8, 8))
        self.project = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.checkpointing = checkpointing
        self.use_reentrant = use_reentrant

    def forward(self, latents, prompt):
        context = self.text_encoder(prompt)
        hidden = self.project(latents)
        gates = []
        for block in self.blocks:

            def gated(x, block=block):
                out = block(x, context)
                return out, torch.sigmoid(out.mean(-1, keepdim=True))

            if self.checkpointing:
                hidden, gate = torch.utils.checkpoint.checkpoint(
                    gated, hidden, use_reentrant=self.use_reentrant
                )
            else:
                hidden, gate = gated(hidden)
            gates.append(gate)
        return (hidden * gates[0] * gates[1]).square().mean()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_each_call_in_a_loop_is_a_region_and_several_outputs_cross(use_reentrant):
    model = GatedLoop(use_reentrant=use_reentrant)
    split = assert_checkpointed_as_eager(model, GatedLoop(checkpointing=False), ARGS, regions=2)
    assert isinstance(split.stage2.checkpointed_0, fx.GraphModule)
    assert isinstance(split.stage2.checkpointed_1, fx.GraphModule)
    assert "return (" in split.stage2.checkpointed_1.code  # the block's output and its gate


class PartialRegion(nn.Module):
    """``fn(x, context)`` whose first layer is frozen: ``functools.partial`` of a method."""

    def __init__(self, checkpointing: bool = True) -> None:
        super().__init__()
        self.encoder = frozen(nn.Sequential(nn.Linear(8, 8), nn.GELU()))
        self.block = Block()
        self.head = nn.Linear(8, 8)
        self.checkpointing = checkpointing

    def run(self, x, *, context):
        encoded = self.encoder(x)  # frozen-only: stage 1 caches it
        return self.head(torch.relu(self.block(encoded, context)))

    def forward(self, x, context):
        function = functools.partial(self.run, context=context)
        if self.checkpointing:
            out = torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False)
        else:
            out = function(x)
        return out.square().mean()


def test_the_trainable_remainder_of_a_partly_cached_region_is_checkpointed():
    model = PartialRegion()
    split = assert_checkpointed_as_eager(model, PartialRegion(checkpointing=False), ARGS, regions=1)
    assert "encoder" in split.boundary  # the frozen prefix of fn, cached by stage 1
    region = split.stage2.checkpointed_0
    assert "self.encoder" not in region.code and "self.block(" in region.code
    assert "self.head(" in region.code


class OneModuleRemainder(nn.Module):
    def __init__(self, checkpointing: bool = True) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(8, 8))
        self.block = Block()
        self.checkpointing = checkpointing

    def forward(self, x, context):
        def custom_forward(x, context):
            return self.block(self.encoder(x), context)

        if self.checkpointing:
            out = torch.utils.checkpoint.checkpoint(custom_forward, x, context, use_reentrant=False)
        else:
            out = custom_forward(x, context)
        return out.square().mean()


def test_a_remainder_of_one_module_call_is_checkpointed_as_that_module():
    model = OneModuleRemainder()
    split = assert_checkpointed_as_eager(
        model, OneModuleRemainder(checkpointing=False), ARGS, regions=1
    )
    assert "torch.utils.checkpoint.checkpoint(block_module, " in split.stage2.code
    assert not hasattr(split.stage2, "checkpointed_0")


def _save_matrix_products(counted: list[str], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    counted.append(str(op))
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("taken_early", [False, True])
def test_a_selective_checkpoint_context_fn_is_held_by_the_stage_and_applied(taken_early):
    decisions: list[str] = []
    context_fn = functools.partial(
        create_selective_checkpoint_contexts, functools.partial(_save_matrix_products, decisions)
    )
    model = MultiOpRegion(taken_early=taken_early, context_fn=context_fn)
    split = assert_checkpointed_as_eager(model, MultiOpRegion(checkpointing=False), ARGS, regions=1)
    assert split.stage2.checkpointed_0_context_fn is context_fn
    assert "context_fn = checkpointed_0_context_fn" in split.stage2.code

    boundary = split.stage1(*ARGS)
    decisions.clear()
    torch.manual_seed(0)
    model(*ARGS).backward()
    eager_decisions = list(decisions)
    decisions.clear()
    torch.manual_seed(0)
    split.stage2(**boundary).backward()
    assert "aten.addmm.default" in decisions
    assert decisions == eager_decisions  # the policy saw the same ops, forward and recompute


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_the_saved_stage_2_code_calls_the_same_region(tmp_path: Path, use_reentrant):
    model = MultiOpRegion(use_reentrant=use_reentrant)
    split = split_and_verify(model, ARGS)
    folder = split.save_code(tmp_path)
    namespace: dict = {}
    exec(compile((folder / "stage2.py").read_text(), "stage2.py", "exec"), namespace)
    saved = namespace["Stage2"](split.stage2)
    boundary = split.stage1(*ARGS)
    torch.manual_seed(0)
    expected = split.stage2(**boundary)
    torch.manual_seed(0)
    assert torch.equal(saved(**boundary), expected)
    assert checkpoint_calls(lambda: saved(**boundary)) == 1


def test_a_copy_of_stage_2_calls_its_own_region_and_pickling_is_refused():
    model = MultiOpRegion()
    split = split_and_verify(model, ARGS)
    boundary = split.stage1(*ARGS)
    copied = copy.deepcopy(split.stage2)  # an EMA copy of the trained modules
    assert copied.checkpointed_0.block1 is copied.block1 is not model.block1
    torch.manual_seed(0)
    expected = split.stage2(**boundary)
    torch.manual_seed(0)
    assert torch.equal(copied(**boundary), expected)
    assert checkpoint_calls(lambda: copied(**boundary)) == 1
    with pytest.raises(graphsplit.SplitError, match="Stage 2 cannot be pickled") as error:
        pickle.dumps(split.stage2)
    assert "would run the region without checkpointing" in str(error.value)
    assert "fix:    save stage 2's state_dict()" in str(error.value)


def test_a_stage_2_checkpointing_module_calls_refuses_pickling_and_so_do_its_copies():
    """fx reloads a pickled stage by tracing its code again, through checkpoint(): the loaded
    stage would train without checkpointing. Refused, for the stage and its deep copies."""
    split = split_and_verify(OneModuleRemainder(), ARGS)
    assert "torch.utils.checkpoint.checkpoint(block_module, " in split.stage2.code
    copied = copy.deepcopy(split.stage2)
    boundary = split.stage1(*ARGS)
    torch.manual_seed(0)  # the block's dropout draws
    expected = split.stage2(**boundary)
    torch.manual_seed(0)
    assert torch.equal(copied(**boundary), expected)
    for stage in (split.stage2, copied):
        with pytest.raises(graphsplit.SplitError, match="Stage 2 cannot be pickled") as error:
            pickle.dumps(stage)
        assert "would run the blocks without checkpointing" in str(error.value)


def test_code_between_the_members_that_reads_them_moves_after_the_region_call():
    """A size check stage 2 inserts after a member (or any node outside the checkpoint that
    reads the region's values) runs after the region's call, on its output."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    inner = graph.call_function(torch.relu, (x,))
    outside = graph.call_function(torch.neg, (inner,))
    last = graph.call_function(torch.add, (inner, 1.0))
    graph.output(graph.call_function(torch.mul, (outside, last)))
    stage = fx.GraphModule(nn.Module(), graph)
    value = batch(2, 8)
    expected = stage(value)

    def wrap(graph, region, inputs):
        return graph.call_function(
            torch.utils.checkpoint.checkpoint, (region, *inputs), {"use_reentrant": False}
        )

    outline(stage, [inner, last], "checkpointed_0", wrap)
    stage.graph.lint()
    stage.recompile()
    assert torch.equal(stage(value), expected)
    order = [node.name for node in stage.graph.nodes]
    assert order.index("neg") > order.index("checkpointed_0_outputs")
    assert "relu = torch.relu(x)" in stage.checkpointed_0.code


def test_a_region_that_is_not_one_piece_of_the_program_is_refused():
    """Outlining needs the region to be contiguous: code outside the checkpoint that reads
    the region's values and is read by it again cannot be one call."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    inner = graph.call_function(torch.relu, (x,))
    outside = graph.call_function(torch.neg, (inner,))
    again = graph.call_function(torch.add, (inner, outside))
    graph.output(again)
    stage = fx.GraphModule(nn.Module(), graph)
    with pytest.raises(graphsplit.SplitError, match="cannot run the checkpointed code") as error:
        outline(stage, [inner, again], "checkpointed_0", lambda *_: None)
    assert "it reads neg, computed outside the checkpoint" in str(error.value)
    assert "fix:" in str(error.value)
