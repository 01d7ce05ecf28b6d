"""Whether ``graphsplit cache`` runs under a multi-process launch, and the accelerator for it.

Under ``accelerate launch --num_processes N`` (or ``torchrun``) every process sees
``WORLD_SIZE=N``, and each must write its own share of the cache. An ``Accelerator`` that
reports a single process (``DistributedType.NO``) while ``WORLD_SIZE`` says more would make
every process believe it is alone: they would all compute every shard and fight over the
folder's lock. The command line refuses that before any work, saying what to fix.

In and out::

    world_size() -> int                         WORLD_SIZE, 1 when unset
    launched_accelerator() -> Accelerator|None  None for one process; raises LaunchError
    check_launch(world, accelerator)            raises LaunchError on a single-process accelerator
"""

from __future__ import annotations

import os
from typing import Any

import torch

from graphsplit.errors import Fix, GraphsplitError, user_error

__all__ = ["LaunchError", "check_launch", "launched_accelerator", "world_size"]

_FIX_WORDS = (  # {world}: the WORLD_SIZE the launcher set
    "launch with accelerate's multi-process mode, e.g. `accelerate launch --multi_gpu "
    "--num_processes {world} -m graphsplit cache ...` (on CPU too), or `accelerate config` with "
    "a distributed type other than NO; or unset WORLD_SIZE to cache from one process"
)


class LaunchError(GraphsplitError):
    """The environment says several processes were launched, but they cannot work together."""


def world_size() -> int:
    """``WORLD_SIZE`` as the launcher set it; 1 when unset or not a number."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_launch(world: int, accelerator: Any) -> None:
    """Refuse an accelerator with one process when ``WORLD_SIZE`` is ``world`` > 1."""
    processes = int(getattr(accelerator, "num_processes", 1))
    if world > 1 and processes != world:
        kind = getattr(accelerator, "distributed_type", "unknown")
        raise user_error(
            LaunchError,
            f"WORLD_SIZE={world}, but accelerate runs {processes} process(es) "
            f"(distributed type {getattr(kind, 'value', kind)}), so every process would cache "
            "as if it were alone and they would contend for the cache folder's lock.",
            fix=Fix(_FIX_WORDS.format(world=world)),
        )


def launched_accelerator() -> Any:
    """An ``accelerate.Accelerator`` when launched with more than one process, else None."""
    world = world_size()
    if world <= 1:
        return None
    try:
        from accelerate import Accelerator  # optional: the hf extra
    except ImportError:
        raise user_error(
            LaunchError,
            f"WORLD_SIZE={world} but accelerate is not installed, so the processes cannot split "
            "the work.",
            fix=Fix("pip install accelerate (or graphsplit[hf]), or unset WORLD_SIZE"),
        ) from None
    try:
        accelerator = Accelerator(cpu=not torch.cuda.is_available())
    except (ValueError, RuntimeError) as error:
        raise user_error(
            LaunchError,
            f"WORLD_SIZE={world}, but accelerate could not start the process group: "
            f"{type(error).__name__}: {error}",
            fix=Fix(_FIX_WORDS.format(world=world)),
        ) from None
    check_launch(world, accelerator)
    return accelerator
