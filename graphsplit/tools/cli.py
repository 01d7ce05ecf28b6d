"""The ``graphsplit`` command line: inspect a step, cache its dataset, check a cache.

Glossary:
    SPEC: ``path/to/file.py:function`` or ``package.module:function``; the function takes no
        arguments and returns a :class:`graphsplit.StepSpec` (see :mod:`graphsplit.tools.spec`).
    inspect: split the step, print the report, and write the generated stage code, ``plan.json``
        and a picture of the split (:mod:`graphsplit.tools.picture`) into a folder.
    cache: run stage 1 over the spec's dataset into a cache folder (under ``accelerate launch``
        each process writes its share).
    check-cache: verify every file of a cache folder.
    exit code: 0 success; 1 the operation failed (the step cannot be split, the cache is
        damaged); 2 a usage error (bad arguments, a spec that cannot be loaded or has no dataset).

In and out::

    graphsplit inspect SPEC [--out DIR]          report on stdout; stage1.py, stage2.py,
                                                 plan.json, split.dot/.html(/.svg) in DIR
    graphsplit cache SPEC --out DIR [--batch-size N] [--shard-bytes N] [--overwrite]
    graphsplit check-cache DIR                   the check's report on stdout

    main(argv: Sequence[str] | None = None) -> int     the exit code
    build_parser() -> argparse.ArgumentParser

Errors go to stderr as ``graphsplit: error: ...`` with the fix, never as a traceback: what is
wrong is in the user's spec or step, not in graphsplit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from graphsplit.api import Split, split
from graphsplit.caching import cache, check_cache
from graphsplit.errors import GraphsplitError
from graphsplit.tools.picture import render_split
from graphsplit.tools.spec import SpecError, StepSpec, load_spec

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_SPEC_HELP = (
    "path/to/file.py:function or package.module:function; the function takes no arguments and "
    "returns graphsplit.StepSpec(model, example_args=(...), example_kwargs=None, "
    "frozen=None, dataset=None)"
)


def _fail(message: str, code: int) -> int:
    print(f"graphsplit: error: {message}", file=sys.stderr)
    return code


def _split(spec: StepSpec) -> Split:
    return split(spec.model, spec.example_args, spec.example_kwargs, frozen=spec.frozen)


def _inspect(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except SpecError as error:
        return _fail(str(error), EXIT_USAGE)
    try:
        parts = _split(spec)
    except GraphsplitError as error:
        return _fail(f"{type(error).__name__}: {error}", EXIT_FAILED)
    print(parts.report())
    out = Path(args.out)
    parts.save_code(out)
    page = render_split(parts, out)
    written = sorted(path.name for path in out.iterdir() if path.is_file())
    print(f"\nwrote {', '.join(written)} to {out}  (open {page} to see the split)")
    return EXIT_OK


def _accelerator_if_launched() -> Any:
    """An ``accelerate.Accelerator`` when run under ``accelerate launch`` with >1 process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import Accelerator  # optional: the hf extra

    return Accelerator(cpu=not torch.cuda.is_available())


@contextlib.contextmanager
def _process_group() -> Iterator[Any]:
    """The launch's accelerator (None without one), whose process group is ended on the way
    out, after every process got there: a group left to the interpreter's exit can abort it
    ("terminate called without an active exception") once the cache is complete."""
    accelerator = _accelerator_if_launched()
    try:
        yield accelerator
    finally:
        if accelerator is not None:
            accelerator.wait_for_everyone()
            accelerator.end_training()


def _cache(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except SpecError as error:
        return _fail(str(error), EXIT_USAGE)
    if spec.dataset is None:
        return _fail(
            f"{args.spec} returned a StepSpec without a dataset, so there is nothing to cache.\n"
            "  fix:    pass dataset=... (items are dicts of the step's inputs, optionally 'key')",
            EXIT_USAGE,
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _fail(
            f"--out {out} is an existing file, not a folder.\n  fix:    pass the path of a "
            "folder (it is created if missing), or move the file away",
            EXIT_USAGE,
        )
    try:
        # Split before the process group exists: tracing imports torch._dynamo, and importing
        # it after gloo started leaves threads that can abort the interpreter at exit.
        parts = _split(spec)
    except GraphsplitError as error:
        return _fail(f"{type(error).__name__}: {error}", EXIT_FAILED)
    with _process_group() as accelerator:
        try:
            batch_size = args.batch_size or _example_batch(spec)
            loader = DataLoader(spec.dataset, batch_size=batch_size, shuffle=False)
            info = cache(
                parts,
                loader,
                out,
                accelerator=accelerator,
                overwrite=args.overwrite,
                shard_bytes=args.shard_bytes,
            )
        except GraphsplitError as error:
            return _fail(f"{type(error).__name__}: {error}", EXIT_FAILED)
        if accelerator is None or accelerator.is_main_process:
            print(info)
    return EXIT_OK


def _example_batch(spec: StepSpec) -> int:
    for value in (*spec.example_args, *spec.example_kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def _check_cache(args: argparse.Namespace) -> int:
    report = check_cache(args.dir)
    print(report)
    return EXIT_OK if report.ok else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphsplit",
        description="Split a PyTorch training step into a cached stage 1 and a training stage 2.",
        epilog="exit codes: 0 success, 1 the operation failed, 2 usage error. "
        "Example: graphsplit inspect my_step.py:step --out plan/",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cache = commands.add_parser(
        "cache",
        help="run stage 1 of SPEC over its dataset into a cache folder (works under "
        "accelerate launch: each process writes its share)",
    )
    cache.add_argument("spec", metavar="SPEC", help="path/to/file.py:function or module:function")
    cache.add_argument("--out", required=True, help="the cache folder")
    cache.add_argument("--batch-size", type=int, help="default: the example batch's size")
    cache.add_argument(
        "--shard-bytes", type=int, default=256 << 20, help="shard size bound (default 256 MiB)"
    )
    cache.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a cache made by another split instead of refusing",
    )
    cache.set_defaults(run=_cache)

    inspect = commands.add_parser(
        "inspect",
        help="print the split report of a step; write its stage code, plan and a picture",
        description="Split the step SPEC names, print the report, and write the generated stage "
        "code (stage1.py, stage2.py), plan.json and a picture (split.dot, split.html, and "
        "split.svg when Graphviz's dot is installed) into --out.",
    )
    inspect.add_argument("spec", metavar="SPEC", help=_SPEC_HELP)
    inspect.add_argument(
        "--out", default="graphsplit-inspect", help="output folder (default graphsplit-inspect)"
    )
    inspect.set_defaults(run=_inspect)

    check = commands.add_parser(
        "check-cache",
        help="verify a cache folder: manifest, every shard's size and checksum",
        description="Verify every file of a graphsplit cache; exit 1 and list the damaged shards "
        "and samples if any.",
    )
    check.add_argument("dir", metavar="DIR", help="the cache folder")
    check.set_defaults(run=_check_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
