"""Gradient checkpointing is kept when the step's code is traced through (issue 11, item 5).

DiffSynth's ``model_fn_wan_video`` loops over the DiT's blocks outside the DiT's forward and
calls ``gradient_checkpoint_forward(block, ...)``, which calls
``torch.utils.checkpoint.checkpoint(create_custom_forward(block), *args, use_reentrant=False)``;
diffusers models call ``self._gradient_checkpointing_func(block, ...)``. Stage 2 must call the
blocks through ``checkpoint`` as the step did: same gradients, same activation memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as checkpoint_taken_early

from tests.helpers import batch, frozen, split_and_verify


def create_custom_forward(module):
    def custom_forward(*inputs, **kwargs):
        return module(*inputs, **kwargs)

    return custom_forward


def gradient_checkpoint_forward(model, use_gradient_checkpointing, offload, *args, **kwargs):
    """DiffSynth's ``gradient_checkpoint_forward`` (without its deepspeed branch)."""
    if offload:
        with torch.autograd.graph.save_on_cpu():
            model_output = torch.utils.checkpoint.checkpoint(
                create_custom_forward(model), *args, **kwargs, use_reentrant=False
            )
    elif use_gradient_checkpointing:
        model_output = torch.utils.checkpoint.checkpoint(
            create_custom_forward(model), *args, **kwargs, use_reentrant=False
        )
    else:
        model_output = model(*args, **kwargs)
    return model_output


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.dropout = nn.Dropout(0.1)  # recomputed in backward with the same RNG state

    def forward(self, x, context):
        return x + self.down(self.dropout(nn.functional.gelu(self.up(x + context))))


class Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])


def model_fn(dit, x, context, use_gradient_checkpointing=False):
    for block in dit.blocks:
        x = gradient_checkpoint_forward(block, use_gradient_checkpointing, False, x, context)
    return x


class DiffSynthStep(nn.Module):
    def __init__(self, checkpointing: bool = True) -> None:
        super().__init__()
        self.text_encoder = frozen(nn.Linear(8, 8))
        self.dit = Dit()
        self.checkpointing = checkpointing

    def forward(self, latents, prompt):
        context = self.text_encoder(prompt)
        noise = torch.randn_like(latents)
        pred = model_fn(self.dit, latents + noise, context, self.checkpointing)
        return nn.functional.mse_loss(pred, noise)


class DiffusersStep(nn.Module):
    """diffusers' default ``_gradient_checkpointing_func``, called on each block."""

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = frozen(nn.Linear(8, 8))
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def _gradient_checkpointing_func(self, module, *args):
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)

    def forward(self, latents, prompt):
        context = self.text_encoder(prompt)
        hidden = latents
        for block in self.blocks:
            hidden = self._gradient_checkpointing_func(block, hidden, context)
        return hidden.square().mean()


@contextlib.contextmanager
def counted_checkpoints() -> Iterator[list[int]]:
    """Count calls of ``torch.utils.checkpoint.checkpoint`` (stage code looks it up by name)."""
    calls: list[int] = []
    original = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch.utils.checkpoint.checkpoint = counting
    try:
        yield calls
    finally:
        torch.utils.checkpoint.checkpoint = original


def saved_tensor_count(run) -> int:
    """Tensors autograd keeps for backward while ``run()`` executes its forward."""
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        run()
    return len(saved)


ARGS = (batch(2, 5, 8), batch(2, 5, 8, seed=1))


def test_diffsynth_checkpointed_blocks_are_checkpointed_in_stage_2():
    model = DiffSynthStep()
    split = split_and_verify(model, ARGS)  # losses and gradients bit for bit
    assert split.stage2.code.count("torch.utils.checkpoint.checkpoint(") == 3
    assert "use_reentrant = False" in split.stage2.code
    boundary = split.stage1(*ARGS)
    with counted_checkpoints() as eager_calls:
        model(*ARGS)
    with counted_checkpoints() as stage2_calls:
        split.stage2(**boundary)
    assert len(stage2_calls) == len(eager_calls) == 3

    eager_saved = saved_tensor_count(lambda: model(*ARGS))
    stage2_saved = saved_tensor_count(lambda: split.stage2(**boundary))
    unsplit = DiffSynthStep(checkpointing=False)
    unsplit.load_state_dict(model.state_dict())
    plain_saved = saved_tensor_count(lambda: unsplit(*ARGS))
    assert stage2_saved == eager_saved < plain_saved


def test_diffusers_gradient_checkpointing_func_is_kept():
    model = DiffusersStep()
    split = split_and_verify(model, ARGS)
    boundary = split.stage1(*ARGS)
    with counted_checkpoints() as calls:
        split.stage2(**boundary)
    assert len(calls) == 2


class FrozenCheckpointed(nn.Module):
    """A frozen, checkpointed encoder block: its work is cached, stage 2 checkpoints nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(Block())
        self.head = nn.Linear(8, 1)

    def forward(self, x, context):
        encoded = torch.utils.checkpoint.checkpoint(self.encoder, x, context, use_reentrant=False)
        return self.head(encoded).mean()


def test_a_checkpointed_call_cached_by_stage_1_is_not_checkpointed_again():
    model = FrozenCheckpointed().eval()
    split = split_and_verify(model, ARGS)
    assert list(split.boundary) == ["encoder"]
    assert "checkpoint" not in split.stage2.code


def test_checkpoint_options_are_passed_on():
    class Options(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = frozen(nn.Linear(8, 8))
            self.block = nn.Linear(8, 8)

        def forward(self, x):
            hidden = self.encoder(x)
            out = torch.utils.checkpoint.checkpoint(
                self.block, hidden, use_reentrant=False, preserve_rng_state=False
            )
            return out.mean()

    split = split_and_verify(Options(), (batch(2, 8),))
    assert "use_reentrant = False, preserve_rng_state = False" in split.stage2.code


class TakenEarly(nn.Module):
    """``checkpoint`` reached by a reference taken before the trace, as transformers does it.

    ``gradient_checkpointing_enable()`` stores ``functools.partial(checkpoint, **kwargs)`` with
    ``checkpoint`` from ``from torch.utils.checkpoint import checkpoint``: replacing the
    attribute ``torch.utils.checkpoint.checkpoint`` during the trace does not reach it.
    """

    def __init__(self, use_reentrant: bool, checkpointing: bool = True) -> None:
        super().__init__()
        self.text_encoder = frozen(nn.Linear(8, 8))
        self.project = nn.Linear(8, 8)  # reentrant checkpoint needs an input that requires grad
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.checkpointing = checkpointing
        self._gradient_checkpointing_func = functools.partial(
            checkpoint_taken_early, use_reentrant=use_reentrant
        )

    def forward(self, latents, prompt):
        context = self.text_encoder(prompt)
        hidden = self.project(latents)
        for block in self.blocks:
            if self.checkpointing:
                hidden = self._gradient_checkpointing_func(block.__call__, hidden, context)
            else:
                hidden = block(hidden, context)
        return hidden.square().mean()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoint_function_taken_before_the_trace_is_kept(use_reentrant):
    model = TakenEarly(use_reentrant)
    args = (batch(2, 5, 8), batch(2, 5, 8, seed=1))
    split = split_and_verify(model, args)
    # The reentrant engine is called through graphsplit's reentrant_checkpoint (it makes sure
    # an input requires grad, see graphsplit.planning.rules.checkpoint), then torch's checkpoint.
    call = "reentrant_checkpoint(" if use_reentrant else "torch.utils.checkpoint.checkpoint("
    assert split.stage2.code.count(call) == 2
    assert f"use_reentrant = {use_reentrant}" in split.stage2.code
    boundary = split.stage1(*args)
    with counted_checkpoints() as calls:
        split.stage2(**boundary)
    assert len(calls) == 2

    unsplit = TakenEarly(use_reentrant, checkpointing=False)
    unsplit.load_state_dict(model.state_dict())
    eager_saved = saved_tensor_count(lambda: model(*args))
    stage2_saved = saved_tensor_count(lambda: split.stage2(**boundary))
    assert stage2_saved == eager_saved < saved_tensor_count(lambda: unsplit(*args))
