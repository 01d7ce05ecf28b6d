"""The ``graphsplit`` command line.

graphsplit demo [--steps N]      split a small text-to-image LoRA step and verify it
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from graphsplit.demo import run_demo

    return run_demo(batch_size=args.batch_size, resolution=args.resolution)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphsplit",
        description="Split a PyTorch training step into a cached stage 1 and a training stage 2.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="split a built-in text-to-image LoRA step (random weights) and verify it"
    )
    demo.add_argument("--batch-size", type=int, default=2, help="samples per batch (default 2)")
    demo.add_argument("--resolution", type=int, default=32, help="image size in px (default 32)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
