"""``graphsplit cache``: load the spec, print the plan, optionally verify, run stage 1.

The steps, each refusing with a message that names the fix in command-line words:

1. load the spec and build the loader: the spec's own ``loader``, or a ``DataLoader`` over its
   ``dataset`` with ``--batch-size`` (default: the example batch's), the spec's ``collate_fn``
   and ``--num-workers`` (default: the spec's ``num_workers``, else 0), never shuffled;
2. split the step and print its plan (``Split.report()``), so the long first minutes of a
   cache run are explained before they start;
3. with ``--verify``: run the unsplit step and the two stages on the loader's first batch and
   compare loss and gradients bit for bit (:func:`graphsplit.verify`);
4. detect the launch (:mod:`graphsplit.tools.launch`) and run :func:`graphsplit.cache`, with a
   tqdm bar on a terminal and a periodic one-line log otherwise
   (:mod:`graphsplit.tools.progress`).

Library errors keep their text; a fix that is one option (a typed
:class:`~graphsplit.errors.Remedy`) is spelled as its flag, because the command runs inside
``speaking(Wording.CLI)``.

In and out::

    run_cache(args: argparse.Namespace) -> int     the exit code
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from graphsplit.api import Split, split
from graphsplit.caching import cache
from graphsplit.caching.store.remote import location
from graphsplit.errors import Fix, GraphsplitError, UnsupportedStorageError, user_error
from graphsplit.signatures.defaults import batch_input_names
from graphsplit.tools.launch import LaunchError, launched_accelerator, world_size
from graphsplit.tools.progress import line_log
from graphsplit.tools.spec import SpecError, StepSpec, load_spec
from graphsplit.verify import verify

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "fail", "run_cache"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "none": None}


def fail(message: str, code: int) -> int:
    """Print ``graphsplit: error: message`` on stderr and return ``code``."""
    print(f"graphsplit: error: {message}", file=sys.stderr)
    return code


def _fail_with(error: GraphsplitError) -> int:
    return fail(f"{type(error).__name__}: {error}", EXIT_FAILED)


def split_spec(spec: StepSpec) -> Split:
    """Split the spec's step with its example batch and frozen choice."""
    return split(spec.model, spec.example_args, spec.example_kwargs, frozen=spec.frozen)


def run_cache(args: argparse.Namespace) -> int:
    """The ``cache`` command; see the module docstring."""
    try:
        spec = load_spec(args.spec)
    except SpecError as error:
        return fail(str(error), EXIT_USAGE)
    problem = _usage_problem(args, spec)
    if problem is not None:
        return fail(problem, EXIT_USAGE)
    main_process = _is_main_process()
    try:
        loader = _loader(args, spec)
        # Split before the process group exists: tracing imports torch._dynamo, and importing
        # it after gloo started leaves threads that can abort the interpreter at exit.
        parts = split_spec(spec)
        if main_process:
            print(parts.report(), flush=True)
        if args.verify:
            _verify_first_batch(spec, parts, loader, main_process)
    except GraphsplitError as error:
        return _fail_with(error)
    storage = STORAGE_DTYPES[args.storage_dtype] if args.storage_dtype else spec.storage_dtype
    try:
        with _process_group() as accelerator, _progress(args) as progress:
            info = cache(
                parts,
                loader,
                args.out,  # a folder or a URL (s3://...): never through Path, which mangles URLs
                accelerator=accelerator,
                overwrite=args.overwrite,
                shard_bytes=args.shard_bytes,
                storage_dtype=storage,
                progress=progress,
                durable=args.durable,
            )
            if accelerator is None or accelerator.is_main_process:
                print(info)
    except LaunchError as error:
        return fail(str(error), EXIT_USAGE)
    except GraphsplitError as error:
        return _fail_with(error)
    return EXIT_OK


def _usage_problem(args: argparse.Namespace, spec: StepSpec) -> str | None:
    """The message of the first way the command line and the spec do not fit, if any."""
    if spec.dataset is None and spec.loader is None:
        return str(
            user_error(
                SpecError,
                f"{args.spec} returned a StepSpec without a dataset or loader, so there is "
                "nothing to cache.",
                fix=Fix(
                    "pass dataset=... (items are dicts of the step's inputs, optionally 'key') "
                    "or loader=... (your DataLoader, not shuffled)"
                ),
            )
        )
    if spec.loader is not None:
        flags = [
            flag
            for flag, value in (
                ("--batch-size", args.batch_size),
                ("--num-workers", args.num_workers),
            )
            if value is not None
        ]
        if flags:
            return str(
                user_error(
                    SpecError,
                    f"{' and '.join(flags)} cannot change the loader {args.spec} returned: it "
                    "already batches the data.",
                    fix=Fix(
                        f"drop {' and '.join(flags)}, or give the spec dataset=... instead of "
                        "loader=..."
                    ),
                )
            )
    try:
        out = location(args.out)
    except UnsupportedStorageError as error:
        return f"--out: {error}"
    if isinstance(out, Path) and out.exists() and not out.is_dir():
        return str(
            user_error(
                SpecError,
                f"--out {out} is an existing file, not a folder.",
                fix=Fix(
                    "pass the path of a folder (it is created if missing), or move the file away"
                ),
            )
        )
    return None


def _loader(args: argparse.Namespace, spec: StepSpec) -> Any:
    if spec.loader is not None:
        return spec.loader
    workers = args.num_workers if args.num_workers is not None else (spec.num_workers or 0)
    return DataLoader(
        spec.dataset,
        batch_size=args.batch_size or _example_batch(spec),
        shuffle=False,
        collate_fn=spec.collate_fn,
        num_workers=workers,
    )


def _example_batch(spec: StepSpec) -> int:
    for value in (*spec.example_args, *spec.example_kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def _verify_first_batch(spec: StepSpec, parts: Split, loader: Any, main_process: bool) -> None:
    """``graphsplit.verify`` on the loader's first batch, bit for bit; raises VerifyError."""
    batch = next(iter(loader), None)
    if batch is None:
        raise user_error(
            SpecError,
            "--verify: the loader yielded no batch.",
            fix=Fix("check the dataset"),
        )
    if isinstance(batch, Mapping):
        names = batch_input_names(parts)  # not those the split took at forward's default
        missing = [name for name in names if name not in batch]
        if missing:
            raise user_error(
                SpecError,
                f"--verify: the first batch has no {missing} (it has {sorted(batch)}), so the "
                "step cannot be run on it.",
                fix=Fix(f"make the batches dicts of the step's inputs {list(names)}"),
            )
        args, kwargs = (), {name: batch[name] for name in names}
    else:
        args, kwargs = tuple(batch), {}
    comparisons = verify(spec.model, parts, args, kwargs)
    grads = sum(comparison.name.startswith("grad ") for comparison in comparisons)
    if main_process:
        print(
            f"verified on the first batch: {len(comparisons) - grads} output(s) and {grads} "
            "gradient(s) of the split equal the unsplit step's, bit for bit",
            flush=True,
        )


def _is_main_process() -> bool:
    return world_size() <= 1 or os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def _process_group() -> Iterator[Any]:
    """The launch's accelerator (None without one), whose process group is ended on the way
    out, after every process got there: a group left to the interpreter's exit can abort it
    ("terminate called without an active exception") once the cache is complete."""
    accelerator = launched_accelerator()
    try:
        yield accelerator
    finally:
        if accelerator is not None:
            accelerator.wait_for_everyone()
            accelerator.end_training()


@contextlib.contextmanager
def _progress(args: argparse.Namespace) -> Iterator[bool | None]:
    """tqdm's own bar on a terminal; elsewhere the bar's lines every ``--log-interval`` s."""
    if sys.stderr.isatty():
        yield None
        return
    with line_log(args.log_interval):
        yield True
