"""The ``graphsplit`` command line.

graphsplit demo [--batch-size N] [--resolution PX]   split a built-in text-to-image LoRA step
graphsplit inspect SPEC [--out DIR]                  report, generated code and picture of a split
graphsplit check-cache DIR                           verify every file of a cache

``SPEC`` is ``path/to/file.py:function`` or ``package.module:function``; the function returns a
:class:`graphsplit.spec.StepSpec`. Exit codes: 0 success, 1 the operation failed (the step cannot
be split, the cache is damaged), 2 usage errors (bad arguments, a spec that cannot be loaded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from graphsplit.spec import SpecError, StepSpec, load_spec

__all__ = ["StepSpec", "build_parser", "main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_SPEC_HELP = (
    "path/to/file.py:function or package.module:function; the function takes no arguments and "
    "returns graphsplit.spec.StepSpec(model, example_args=(...), example_kwargs=None, "
    "frozen=None, dataset=None)"
)


def _fail(message: str, code: int) -> int:
    print(f"graphsplit: error: {message}", file=sys.stderr)
    return code


def _demo(args: argparse.Namespace) -> int:
    from graphsplit.demo import run_demo

    return run_demo(batch_size=args.batch_size, resolution=args.resolution)


def _inspect(args: argparse.Namespace) -> int:
    from graphsplit.api import split
    from graphsplit.errors import GraphsplitError
    from graphsplit.picture import render_split

    try:
        spec = load_spec(args.spec)
    except SpecError as error:
        return _fail(str(error), EXIT_USAGE)
    try:
        parts = split(spec.model, spec.example_args, spec.example_kwargs, frozen=spec.frozen)
    except GraphsplitError as error:
        return _fail(f"{type(error).__name__}: {error}", EXIT_FAILED)
    print(parts.report())
    out = Path(args.out)
    parts.save_code(out)
    page = render_split(parts, out)
    written = sorted(path.name for path in out.iterdir() if path.is_file())
    print(f"\nwrote {', '.join(written)} to {out}  (open {page} to see the split)")
    return EXIT_OK


def _check_cache(args: argparse.Namespace) -> int:
    try:
        from graphsplit.data import check_cache
    except ImportError as error:
        return _fail(f"cache checking is not available in this install ({error})", EXIT_USAGE)
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
    demo = commands.add_parser(
        "demo", help="split a built-in text-to-image LoRA step (random weights) and verify it"
    )
    demo.add_argument("--batch-size", type=int, default=2, help="samples per batch (default 2)")
    demo.add_argument("--resolution", type=int, default=32, help="image size in px (default 32)")
    demo.set_defaults(run=_demo)

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
