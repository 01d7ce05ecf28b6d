"""What every benchmark script shares: its options, memory readings, tables and result files.

Glossary:
    results folder: where a script writes ``<stem>.json`` and ``<stem>.md`` (``--out``; by
        default ``benchmarks/results/``, not committed). docs/benchmarks.md copies the tables.
    report: ``{"benchmark": name, "environment": ..., "results": rows}``, the JSON layout of the
        benchmarks that record their environment (others write their rows as they are).
    environment: library versions (read from the installed metadata, so nothing is imported),
        Python, platform and CPU count.
    peak RSS: a process's own resident-set high-water mark (``VmHWM`` on Linux). Unlike
        ``ru_maxrss``, it is not inherited across ``exec``: a child started by a parent that
        holds torch does not start from the parent's size.
    child: a fresh interpreter running ``python -m benchmarks.X --child ...``, so that its
        memory is its own; it answers with one JSON line (:func:`reply_to_parent`).

In and out:
    parser(module, description) -> ArgumentParser          with --out (Path) already added
    environment(*libraries, torch_threads=False) -> dict
    report(name, results, environment) -> dict
    write_results(out, stem, payload, markdown) -> (json_path, markdown_path)
    markdown_table(header, rows, align) -> str             align: one l or r per column
    peak_rss_bytes() -> int ; current_rss_bytes() -> int ; python_heap_peak_bytes(fn) -> int
    mib(count) -> float                                     for fixed-unit MiB columns
    run_child(module, argv, timeout=None) -> dict          raises ChildFailed
    reply_to_parent(row) -> None

This module imports neither torch nor graphsplit: the memory benchmark's parent process must
stay small (see :func:`peak_rss_bytes`), and the demo reads its own peak RSS from here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

__all__ = [
    "REPOSITORY",
    "RESULTS",
    "ChildFailed",
    "current_rss_bytes",
    "environment",
    "markdown_table",
    "mib",
    "parser",
    "peak_rss_bytes",
    "python_heap_peak_bytes",
    "reply_to_parent",
    "report",
    "run_child",
    "write_results",
]

REPOSITORY = Path(__file__).resolve().parent.parent
RESULTS = REPOSITORY / "benchmarks" / "results"


# -- options ----------------------------------------------------------------------------------
def parser(module: str, description: str) -> argparse.ArgumentParser:
    """The script's argument parser, ``--out`` included.

    Args:
        module: the script's module name (``"bench_memory"``), for ``usage: python -m ...``.
        description: the first paragraph is shown by ``--help`` (pass the module docstring).
    """
    command = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{module}", description=description.split("\n\n")[0]
    )
    command.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="folder for the JSON and markdown results (default: benchmarks/results/)",
    )
    return command


# -- what ran where ---------------------------------------------------------------------------
def environment(*libraries: str, torch_threads: bool = False) -> dict[str, Any]:
    """Versions of ``libraries`` and of Python, the platform and the CPU count.

    ``torch_threads`` adds ``torch.get_num_threads()``, which imports torch.
    """
    described: dict[str, Any] = {name: _version(name) for name in libraries}
    described.update(
        python=platform.python_version(), platform=platform.platform(), cpus=os.cpu_count()
    )
    if torch_threads:
        import torch

        described["torch_threads"] = torch.get_num_threads()
    return described


def _version(library: str) -> str | None:
    try:
        return version(library)
    except PackageNotFoundError:
        return None


def report(name: str, results: Any, environment: dict[str, Any]) -> dict[str, Any]:
    """The JSON layout of a benchmark that records where it ran."""
    return {"benchmark": name, "environment": environment, "results": results}


# -- results ----------------------------------------------------------------------------------
def write_results(out: Path, stem: str, payload: Any, markdown: str) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out``, print the markdown and the paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    markdown_path.write_text(markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path}")
    return json_path, markdown_path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str) -> str:
    """A markdown table; ``align`` has one letter per column: ``l`` (text) or ``r`` (numbers).

    Example:
        >>> print(markdown_table(["case", "MiB"], [["tiny", f"{mib(3 * 2**20):.0f}"]], "lr"))
        | case | MiB |
        |---|---:|
        | tiny | 3 |
        <BLANKLINE>
    """
    assert len(align) == len(header) and set(align) <= {"l", "r"}, align
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "".join("---|" if side == "l" else "---:|" for side in align),
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def mib(count: float) -> float:
    """Bytes as MiB, for the fixed-unit columns and ``*_mib`` fields of the results."""
    return count / 2**20


# -- memory -----------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """This process's own peak resident set size.

    ``ru_maxrss`` survives ``exec`` (a child starts from its parent's RSS at fork time), so on
    Linux this reads the memory map's high-water mark, which a new program resets.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # ru_maxrss is KiB on Linux and bytes on macOS.
    unit = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


def current_rss_bytes() -> int:
    """This process's resident set size now (Linux); elsewhere its peak."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def python_heap_peak_bytes(function: Callable[[], Any]) -> int:
    """The Python heap's highest point while ``function()`` runs (tracemalloc).

    Tracing slows every allocation down, so time ``function`` in a separate, untraced call.
    """
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- fresh processes --------------------------------------------------------------------------
class ChildFailed(RuntimeError):
    """A child process exited without a JSON line; ``tail`` holds its last lines of output."""

    def __init__(self, returncode: int, tail: str) -> None:
        super().__init__(f"exited {returncode}: {tail}")
        self.returncode = returncode
        self.tail = tail


def run_child(module: str, argv: Sequence[str], *, timeout: float | None = None) -> dict:
    """Run ``python -m module *argv`` in a fresh interpreter; the last JSON line it printed.

    Raises:
        ChildFailed: it printed no JSON line (it crashed).
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
    """
    command = [sys.executable, "-m", module, *argv]
    done = subprocess.run(
        command, cwd=REPOSITORY, capture_output=True, text=True, timeout=timeout, check=False
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    raise ChildFailed(done.returncode, tail)


def reply_to_parent(row: dict[str, Any]) -> None:
    """The child's side of :func:`run_child`: one JSON line on stdout."""
    print(json.dumps(row), flush=True)
