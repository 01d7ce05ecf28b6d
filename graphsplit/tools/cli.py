"""The ``graphsplit`` command line: inspect a step, cache its dataset, check a cache.

Glossary:
    SPEC: ``path/to/file.py:function`` or ``package.module:function``; the function takes no
        arguments and returns a :class:`graphsplit.StepSpec` (see :mod:`graphsplit.tools.spec`).
    inspect: split the step, print the report, and write the generated stage code, ``plan.json``
        and a picture of the split (:mod:`graphsplit.tools.picture`) into a folder.
    cache: print the plan, optionally verify the split on the first batch, then run stage 1
        over the spec's data into a cache folder (under ``accelerate launch`` each process
        writes its share); see :mod:`graphsplit.tools.cache_command`.
    check-cache: verify every file of a cache folder.
    export: write a cache as a Hugging Face ``datasets`` dataset (a ``save_to_disk`` folder or a
        parquet file) to push to the Hub or stream; see :mod:`graphsplit.caching.read.hf_export`.
    CLI words: every error's typed remedy (:class:`graphsplit.errors.Remedy`) is rendered as
        its flag (``--overwrite``), since ``main`` runs inside ``speaking(Wording.CLI)``.
    exit code: 0 success; 1 the operation failed (the step cannot be split, the cache is
        damaged); 2 a usage error (bad arguments, a spec that cannot be loaded or has no dataset).

In and out::

    graphsplit inspect SPEC [--out DIR]          report on stdout; stage1.py, stage2.py,
                                                 plan.json, split.dot/.html(/.svg) in DIR
    graphsplit cache SPEC --out DIR [--batch-size N] [--num-workers N] [--shard-bytes N]
                     [--storage-dtype {bfloat16,float16,none}] [--verify] [--overwrite]
                     [--no-fsync] [--log-interval SECONDS]   plan, progress, the CacheInfo
    graphsplit --version
    graphsplit check-cache DIR                   the check's report on stdout
    graphsplit export DIR --out DEST [--parquet] [--overwrite]
                                                 DEST: datasets.load_from_disk / parquet

    main(argv: Sequence[str] | None = None) -> int     the exit code
    build_parser() -> argparse.ArgumentParser

Errors go to stderr as ``graphsplit: error: ...`` with the fix, never as a traceback: what is
wrong is in the user's spec or step, not in graphsplit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from graphsplit.caching import check_cache
from graphsplit.errors import GraphsplitError, Wording, speaking
from graphsplit.tools.cache_command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    STORAGE_DTYPES,
    fail,
    run_cache,
    split_spec,
)
from graphsplit.tools.picture import render_split
from graphsplit.tools.spec import SpecError, load_spec
from graphsplit.version import __version__

__all__ = ["build_parser", "main"]

_SPEC_HELP = (
    "path/to/file.py:function or package.module:function; the function takes no arguments and "
    "returns graphsplit.StepSpec(model, example_args=(...), example_kwargs=None, "
    "frozen=None, dataset=None, loader=None, collate_fn=None, num_workers=None, "
    "storage_dtype=None)"
)


def _inspect(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except SpecError as error:
        return fail(str(error), EXIT_USAGE)
    try:
        parts = split_spec(spec)
    except GraphsplitError as error:
        return fail(f"{type(error).__name__}: {error}", EXIT_FAILED)
    print(parts.report())
    out = Path(args.out)
    parts.save_code(out)
    written = sorted(path.name for path in out.iterdir() if path.is_file())
    if getattr(parts, "path", "trace") != "trace":  # the module-level path has no graph to draw
        print(f"\nwrote {', '.join(written)} to {out}")
        return EXIT_OK
    page = render_split(parts, out)
    written = sorted(path.name for path in out.iterdir() if path.is_file())
    print(f"\nwrote {', '.join(written)} to {out}  (open {page} to see the split)")
    return EXIT_OK


def _check_cache(args: argparse.Namespace) -> int:
    report = check_cache(args.dir)
    print(report)
    return EXIT_OK if report.ok else EXIT_FAILED


def _export(args: argparse.Namespace) -> int:
    from graphsplit.caching.read.hf_export import export_cache

    out = export_cache(args.dir, args.out, overwrite=args.overwrite, parquet=args.parquet)
    print(f"wrote the cache at {args.dir} as a datasets dataset to {out}")
    return EXIT_OK


def _add_export(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="write a cache as a Hugging Face datasets dataset (to push to the Hub or stream)",
        description="Write the cache DIR as a datasets dataset, one row per sample, with the "
        "cache's fingerprint in its features metadata: a save_to_disk folder "
        "(datasets.load_from_disk) or, with --parquet, one parquet file. Read it back for "
        "stage 2 with graphsplit.caching.read.hf_export.HFCachedDataset. Needs the datasets "
        "package.",
    )
    export.add_argument("dir", metavar="DIR", help="the cache folder")
    export.add_argument(
        "--out",
        required=True,
        help="the folder (or parquet file) to write: a local path or a URL (s3://bucket/x)",
    )
    export.add_argument("--parquet", action="store_true", help="write one parquet file")
    export.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export at --out"
    )
    export.set_defaults(run=_export)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _add_cache(commands: argparse._SubParsersAction) -> None:
    cache = commands.add_parser(
        "cache",
        help="print the plan, then run stage 1 of SPEC over its data into a cache folder (works "
        "under accelerate launch: each process writes its share)",
        description="Split the step SPEC names, print the plan, and run stage 1 over the spec's "
        "loader (or its dataset, batched here) into --out. Progress: a bar on a terminal, "
        "one line every --log-interval seconds otherwise (a Slurm or CI log).",
    )
    cache.add_argument("spec", metavar="SPEC", help=_SPEC_HELP)
    cache.add_argument("--out", required=True, help="the cache folder")
    cache.add_argument(
        "--batch-size", type=_positive, help="default: the example batch's size (dataset only)"
    )
    cache.add_argument(
        "--num-workers",
        type=_non_negative,
        help="DataLoader worker processes for the dataset (default: the spec's num_workers, "
        "else 0)",
    )
    cache.add_argument(
        "--shard-bytes",
        type=_positive,
        default=256 << 20,
        help="shard size bound (default 256 MiB)",
    )
    cache.add_argument(
        "--storage-dtype",
        choices=sorted(STORAGE_DTYPES),
        help="store floats as bfloat16 or float16 (lossy; the error is recorded), or none "
        "(lossless); default: the spec's storage_dtype, else lossless",
    )
    cache.add_argument(
        "--verify",
        action="store_true",
        help="before caching, check on the first batch that the split reproduces the step's "
        "loss and gradients bit for bit (graphsplit.verify)",
    )
    cache.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a cache made by another split instead of refusing",
    )
    cache.add_argument(
        "--no-fsync",
        dest="durable",
        action="store_false",
        help="write without fsync (durable=False): faster, survives a crash of the process "
        "but not a power cut; after a restart the cache is verified before it is read",
    )
    cache.add_argument(
        "--log-interval",
        type=_seconds,
        default=30.0,
        help="seconds between progress lines when stderr is not a terminal (default 30)",
    )
    cache.set_defaults(run=run_cache)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphsplit",
        description="Split a PyTorch training step into a cached stage 1 and a training stage 2.",
        epilog="exit codes: 0 success, 1 the operation failed, 2 usage error. "
        "Example: graphsplit inspect examples/sd_spec.py:step --out plan/",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"graphsplit {__version__} (torch {torch.__version__})",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_cache(commands)

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
    _add_export(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with speaking(Wording.CLI):
        try:
            return args.run(args)
        except GraphsplitError as error:  # one the command did not catch: still no traceback
            return fail(f"{type(error).__name__}: {error}", EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
