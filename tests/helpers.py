"""Shared test helper: split a step, check its structure, and check exactness against eager."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn

import graphsplit


def split_and_verify(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, **split_kwargs
) -> graphsplit.Split:
    """Split ``model`` and assert the stages reproduce it bit for bit (outputs and gradients)."""
    split = graphsplit.split(model, args, kwargs, **split_kwargs)
    comparisons = graphsplit.verify(model, split, args, kwargs, seed=0)
    assert comparisons and all(c.ok for c in comparisons)
    assert_stage1_holds_no_trainable(split)
    return split


def assert_stage1_holds_no_trainable(split: graphsplit.Split) -> None:
    model = split._model
    names = {id(p): n for n, p in model.named_parameters()}
    held = {names[id(p)] for p in split.stage1.parameters()}
    assert not held & split.trainable, f"stage 1 holds trainable {held & split.trainable}"


def param_names(module: nn.Module, model: nn.Module) -> set[str]:
    """Names (as in ``model``) of the parameters ``module`` holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in module.parameters()}


def batch(size: int, *shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, *shape, generator=generator)


def line_of(owner: object, text: str) -> str:
    """``file.py:N`` for the one line of ``owner``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(owner)
    matches = [start + offset for offset, line in enumerate(lines) if text in line]
    assert len(matches) == 1, f"{text!r} found {len(matches)} times"
    return f"{Path(inspect.getsourcefile(owner)).name}:{matches[0]}"


def stage2_names(split: graphsplit.Split) -> set[str]:
    return {node.name for node in split.cut.stage2}


def stage1_names(split: graphsplit.Split) -> set[str]:
    return {node.name for node in split.cut.stage1}


def boundary_summary(split: graphsplit.Split) -> dict[str, tuple]:
    """``{key: (shape, batch_dim, bytes_per_sample)}`` of the boundary."""
    return {
        key: (spec.shape, spec.batch_dim, spec.bytes_per_sample)
        for key, spec in split.boundary.items()
    }


def frozen(module: nn.Module) -> nn.Module:
    return module.requires_grad_(False)


def node_named(split: graphsplit.Split, name: str) -> torch.fx.Node:
    return next(node for node in split.graph.nodes if node.name == name)


def free_port() -> int:
    """A TCP port the OS says is free now (a fixed one collides with a second suite beside us)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_process_launch(*worker_argv: str) -> list[str]:
    """The command that runs a worker script as two CPU processes under ``accelerate launch``.

    ``--multi_gpu`` selects accelerate's torchrun launcher; the worker's
    ``Accelerator(cpu=True)`` makes it a two-process CPU (gloo) run (``--cpu --num_processes
    2`` alone starts only one process unless MPI is configured). Each launch takes a free port.
    """
    import sys

    return [
        *(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"),
        *("--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"),
        *("--dynamo_backend", "no", "--main_process_port", str(free_port())),
        *worker_argv,
    ]


def tiny_llama_config(**overrides: Any) -> Any:
    """A two-layer ``LlamaConfig`` small enough for CPU tests: 32 wide, 2 heads, 1 KV head."""
    import transformers

    settings = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
    }
    return transformers.LlamaConfig(**{**settings, **overrides})
