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
    round: one call of every variant being compared, back to back. Rounds alternate the order
        (A B, then B A, ...), so neither variant always runs right after the other and a slow
        drift of the machine's load hits both alike.
    same-round ratio: ``A / B`` within one round. On a shared machine the load changes between
        rounds far more than within one, so the median of same-round ratios is far steadier
        than the ratio of two medians.
    spread: the median with the interquartile range (IQR: the 25th and 75th percentile) of a
        list of measurements; every figure in docs/benchmarks.md states one.
    wall and CPU time: ``time.perf_counter`` and ``time.process_time`` around each call. CPU
        time (all threads of this process) leaves out the time another job had the core, so it
        is the cross-check when the wall-clock figures move. It is not immune to load: a busy
        neighbour sharing the caches and memory bus slows each instruction, so CPU seconds
        taken at different loads differ too -- which is why a comparison of two versions of
        graphsplit alternates them (:func:`versus_baseline`) instead of quoting old figures.
    baseline: another version of graphsplit to compare against: a git revision of this
        repository (exported with ``git archive``) or a folder holding a ``graphsplit``
        package. Its children run with this checkout's ``benchmarks`` and ``tests`` (the same
        models and the same measuring code) and only ``graphsplit`` swapped.

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
    timing_options(command, rounds=...) -> command         adds --threads, --rounds, --quick
    torch_threads(count) -> context manager yielding the torch thread count (imports torch)
    interleaved(variants, rounds=, warmup=) -> Timings      wall and CPU seconds per round
    Timings.ratio(a, b, clock) -> Spread ; Timings.spread(name, clock) -> Spread
    spread(values) -> Spread                                median and IQR
    baseline_code(spec, folder) -> Path                     a checkout whose graphsplit is spec's
    versus_baseline(measure, baseline, rounds=) -> Timings  "current" and "baseline", alternating

This module imports neither torch nor graphsplit: the memory benchmark's parent process must
stay small (see :func:`peak_rss_bytes`), and the demo reads its own peak RSS from here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

__all__ = [
    "REPOSITORY",
    "RESULTS",
    "ChildFailed",
    "Spread",
    "Timings",
    "current_rss_bytes",
    "environment",
    "interleaved",
    "markdown_table",
    "mib",
    "parser",
    "peak_rss_bytes",
    "python_heap_peak_bytes",
    "reply_to_parent",
    "report",
    "run_child",
    "spread",
    "timing_options",
    "torch_threads",
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


def run_child(
    module: str, argv: Sequence[str], *, timeout: float | None = None, cwd: Path | None = None
) -> dict:
    """Run ``python -m module *argv`` in a fresh interpreter; the last JSON line it printed.

    ``cwd`` (default: this checkout) is the folder the child imports ``graphsplit`` from:
    ``python -m`` puts it first on ``sys.path`` (see :func:`baseline_code`).

    Raises:
        ChildFailed: it printed no JSON line (it crashed).
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
    """
    command = [sys.executable, "-m", module, *argv]
    done = subprocess.run(
        command,
        cwd=cwd or REPOSITORY,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    raise ChildFailed(done.returncode, tail)


def reply_to_parent(row: dict[str, Any]) -> None:
    """The child's side of :func:`run_child`: one JSON line on stdout."""
    print(json.dumps(row), flush=True)


# -- timing on a shared machine ---------------------------------------------------------------
def timing_options(command: argparse.ArgumentParser, *, rounds: int) -> argparse.ArgumentParser:
    """Add ``--threads`` (default 1), ``--rounds`` and ``--quick`` to a timing script's parser.

    One torch thread is the default because on a machine whose cores other jobs share, a
    second intra-op thread waits for a busy core at every parallel region: the step then times
    the other jobs, not the code. ``--quick`` is each script's smallest run, for the CI smoke
    tests and ``make bench``; its numbers mean nothing.
    """
    command.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 0 keeps torch's default (default: 1, steady on a busy "
        "machine)",
    )
    command.add_argument(
        "--rounds", type=int, default=rounds, help=f"timed rounds (default: {rounds})"
    )
    command.add_argument(
        "--quick",
        action="store_true",
        help="the smallest run, for smoke tests: numbers mean nothing",
    )
    return command


@contextmanager
def torch_threads(count: int) -> Iterator[int]:
    """Run with ``count`` torch intra-op threads (0: torch's default); yields the count in use.

    The previous count comes back afterwards, so a test calling a script's ``main`` leaves the
    rest of the suite as it found it.
    """
    import torch

    previous = torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class Spread:
    """The median of some measurements and their interquartile range.

    Example:
        >>> print(spread([1.0, 2.0, 3.0, 4.0, 100.0]))
        2.000 (IQR 2.000–4.000, n=5)
    """

    median: float
    q1: float
    q3: float
    count: int

    def __str__(self) -> str:
        return self.format(".3f")

    def format(self, spec: str) -> str:
        """``median (IQR q1–q3, n=count)`` with each number formatted by ``spec``."""
        return f"{self.median:{spec}} (IQR {self.q1:{spec}}–{self.q3:{spec}}, n={self.count})"

    def to_json(self) -> dict[str, float]:
        return {"median": self.median, "q1": self.q1, "q3": self.q3, "count": self.count}


def spread(values: Sequence[float]) -> Spread:
    """Median and quartiles of ``values`` (inclusive method: the quartiles lie within them)."""
    if not values:
        raise ValueError("spread() needs at least one value")
    if len(values) == 1:
        (only,) = values
        return Spread(only, only, only, 1)
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(median, q1, q3, len(values))


CLOCKS = ("wall", "cpu")


@dataclass
class Timings:
    """Seconds of each variant in each timed round, on both clocks (``wall`` and ``cpu``)."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def seconds(self, name: str, clock: str = "wall") -> list[float]:
        assert clock in CLOCKS, clock
        return getattr(self, clock)[name]

    def spread(self, name: str, clock: str = "wall") -> Spread:
        """Median and IQR of one variant's seconds."""
        return spread(self.seconds(name, clock))

    def ratio(self, numerator: str, denominator: str, clock: str = "wall") -> Spread:
        """Median and IQR of the same-round ratios ``numerator / denominator``."""
        pairs = zip(self.seconds(numerator, clock), self.seconds(denominator, clock))
        return spread([a / b for a, b in pairs])

    def to_json(self) -> dict[str, Any]:
        """Every variant's spread on both clocks, and the raw seconds."""
        return {
            clock: {
                name: {**spread(values).to_json(), "seconds": values}
                for name, values in getattr(self, clock).items()
            }
            for clock in CLOCKS
        }


def interleaved(
    variants: Mapping[str, Callable[[], Any]],
    *,
    rounds: int,
    warmup: int = 1,
    before_each: Callable[[str, int], Any] | None = None,
) -> Timings:
    """Time each variant once per round, alternating the order of the variants every round.

    Args:
        variants: name -> a call to time; it must finish its work before returning (on a GPU:
            synchronise inside it).
        rounds: timed rounds; ``warmup`` untimed rounds run first.
        before_each: ``before_each(name, round)`` runs untimed before each call (reset
            gradients, seed the generator, empty a folder).

    Returns:
        The wall-clock and CPU seconds of every call of the timed rounds.
    """
    names = list(variants)
    timings = Timings({name: [] for name in names}, {name: [] for name in names})
    for index in range(warmup + rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            if before_each is not None:
                before_each(name, index)
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if index >= warmup:
                timings.wall[name].append(wall)
                timings.cpu[name].append(cpu)
    return timings


# -- comparing two versions of graphsplit -----------------------------------------------------
def baseline_code(spec: str, folder: Path) -> Path:
    """A folder to run children in whose ``graphsplit`` is the baseline's; the rest is ours.

    Args:
        spec: a folder holding a ``graphsplit`` package (or the package folder itself), or a
            git revision of this repository (``HEAD~3``, a commit), exported with ``git
            archive`` into ``folder``.
        folder: an empty folder that outlives the children (a temporary directory).

    Returns:
        ``folder``, holding ``graphsplit`` (the baseline's) and links to this checkout's
        ``benchmarks``, ``tests`` and ``examples``, so both versions run the same builders and
        measurements.
    """
    given = Path(spec).expanduser()
    package = given / "graphsplit" if (given / "graphsplit").is_dir() else given
    if (package / "__init__.py").is_file() and package.name == "graphsplit":
        (folder / "graphsplit").symlink_to(package.resolve(), target_is_directory=True)
    else:
        archive = subprocess.run(
            ["git", "-C", str(REPOSITORY), "archive", "--format=tar", spec, "graphsplit"],
            capture_output=True,
            check=False,
        )
        if archive.returncode != 0:
            raise ValueError(
                f"baseline {spec!r} is neither a folder holding a graphsplit package nor a git "
                f"revision of {REPOSITORY}: {archive.stderr.decode().strip()}"
            )
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    for name in ("benchmarks", "tests", "examples"):
        (folder / name).symlink_to(REPOSITORY / name, target_is_directory=True)
    return folder


def versus_baseline(
    measure: Callable[[Path | None], tuple[float, float]],
    baseline: Path,
    *,
    rounds: int,
) -> Timings:
    """Time the current graphsplit and the baseline in alternating child processes.

    Args:
        measure: ``measure(cwd)`` runs one child in ``cwd`` (None: this checkout) and returns
            the ``(wall, cpu)`` seconds the child measured for the work being compared.
        baseline: the folder from :func:`baseline_code`.
        rounds: pairs of children; the order alternates (current first, then baseline first).

    Returns:
        Timings with the variants ``"current"`` and ``"baseline"``: ``ratio("current",
        "baseline")`` is the same-round ratio (below 1: the current code is faster).
    """
    where = {"current": None, "baseline": baseline}
    timings = Timings({name: [] for name in where}, {name: [] for name in where})
    for index in range(rounds):
        for name in list(where) if index % 2 == 0 else list(where)[::-1]:
            wall, cpu = measure(where[name])
            timings.wall[name].append(wall)
            timings.cpu[name].append(cpu)
    return timings


def compare_with_baseline(
    measure: Callable[[Path | None], tuple[float, float, str]],
    baseline: Path,
    *,
    rounds: int,
) -> dict[str, Any]:
    """:func:`versus_baseline` with plan digests: the row both planning benchmarks report.

    ``measure(cwd)`` returns ``(wall, cpu, plan_digest)`` of one child; *same plan* is true
    when every child of both versions made the same plan.
    """
    digests: dict[str, set[str]] = {"current": set(), "baseline": set()}

    def timed(code: Path | None) -> tuple[float, float]:
        wall, cpu, digest = measure(code)
        digests["baseline" if code else "current"].add(digest)
        return wall, cpu

    timings = versus_baseline(timed, baseline, rounds=rounds)
    return {
        "rounds": rounds,
        "timings": timings.to_json(),
        "cpu_ratio": timings.ratio("current", "baseline", "cpu").to_json(),
        "wall_ratio": timings.ratio("current", "baseline", "wall").to_json(),
        "same_plan": len(digests["current"] | digests["baseline"]) == 1,
        "digests": {name: sorted(values) for name, values in digests.items()},
    }


def ratio_text(value: dict[str, float]) -> str:
    """A ratio's median and IQR, as the tables print it: ``0.695 (0.639–0.703)``."""
    return f"{value['median']:.3f} ({value['q1']:.3f}–{value['q3']:.3f})"


def baseline_table(
    rows: list[tuple[Any, dict[str, Any]]], first_column: str, *, first_align: str = "l"
) -> str:
    """The "against the baseline" paragraph and table, one row per ``(label, comparison)``."""
    header = [first_column, "pairs", "baseline CPU s", "current CPU s",
              "current / baseline, CPU", "current / baseline, wall", "same plan"]  # fmt: skip
    cells = []
    for label, versus in rows:
        cpu = versus["timings"]["cpu"]
        cells.append([
            label, versus["rounds"], f"{cpu['baseline']['median']:.2f}",
            f"{cpu['current']['median']:.2f}", ratio_text(versus["cpu_ratio"]),
            ratio_text(versus["wall_ratio"]), "yes" if versus["same_plan"] else "**no**",
        ])  # fmt: skip
    return (
        f"Against the baseline {rows[0][1].get('baseline', '')}: median (IQR) of same-round "
        "ratios of alternating child processes\n\n"
        + markdown_table(header, cells, first_align + "rrrrrl")
    )
