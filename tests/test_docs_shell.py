"""Every shell command in README.md and docs/*.md runs, as the Python snippets do (test_docs.py).

A page's ```` ```bash ```` blocks are read as a shell reads them: ``#`` starts a comment (a line
that is only a comment continues the note of the line above), a trailing backslash joins lines.
Each command is, in page order:

- **run**: in a fresh folder holding a link to ``examples/``, with the interpreter's ``bin``
  first on ``PATH`` (``python``, the ``graphsplit`` console script, or a stand-in calling
  ``python -m graphsplit``) and this checkout on ``PYTHONPATH``; it must exit 0. A command
  naming an ``s3://`` bucket runs against the suite's local S3 server
  (:class:`tests.caching.s3_server.LocalS3`, the same the S3 tests and the docs' snippets use),
  which points the process's AWS endpoint and keys at itself, with the bucket made afresh. A
  command the page repeats (README and docs/index.md show the same three) runs once, in the
  first block;
- **not run**, listed in :data:`NOT_RUN` with the reason. A benchmark's measurement run of a
  minute or more still has its documented arguments parsed by its own ``main``'s parser, so a
  renamed flag fails here; tests/bench runs each entry point at tiny sizes.

Nothing is filtered silently: a new command runs unless it is added to ``NOT_RUN``, an entry of
``NOT_RUN`` that no page shows any more fails, and a command in an unlabelled block fails
(label it ```` ```bash ````).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]


def _measurement(seconds: str) -> str:
    return (
        f"a measurement run of {seconds} on this 2-core machine at the documented sizes; its "
        "arguments are parsed by its own parser here, and tests/bench runs it at tiny sizes"
    )


# Commands the suite does not run, each with the reason. (Measurements of about 10 s run:
# bench_cache_bytes, bench_fingerprint, gpu --dry-run.)
NOT_RUN: dict[str, str] = {
    "make demo": "creates .venv and installs the pinned dependencies (network), then runs "
    "examples/demo.py, which tests/examples runs",
    "make test": "runs ruff and this very suite",
    "python -m benchmarks.bench_step_time --sizes small heavy_frozen --rounds 40 --out "
    "benchmarks/results": _measurement("60 s"),
    "python -m benchmarks.bench_memory --sizes heavy_frozen small --steps 3 --repeats 3 --out "
    "benchmarks/results": _measurement("over 90 s"),
    "python -m benchmarks.bench_cache_io --rounds 15 --large-rounds 9 --out benchmarks/results": (
        _measurement("67 s")
    ),
    "python -m benchmarks.bench_diffsynth_bytes --out benchmarks/results": _measurement("140 s"),
    "python -m benchmarks.bench_live_cache --rounds 20 --out benchmarks/results": _measurement(
        "over 3 minutes"
    ),
    "python -m benchmarks.bench_split_scale --full --rounds 3 --baseline ba75bc5 --out "
    "benchmarks/results": _measurement("minutes (--full)"),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux flux_diffusers_ids --rounds 3 "
    "--baseline ba75bc5 --out benchmarks/results": _measurement("minutes (SDXL and Flux sizes)"),
    "python -m benchmarks.bench_dpo_reference --out benchmarks/results": _measurement("90 s"),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 5 --baseline ../wt-perf-base "
    "--out /tmp/perf9": _measurement("minutes, with a baseline worktree"),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 8 --baseline ../wt-perf-base "
    "--out /tmp/perf9": _measurement("minutes, with a baseline worktree"),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux --rounds 3 --baseline ../wt-perf-base "
    "--out /tmp/perf9p": _measurement("minutes (SDXL and Flux sizes, with a baseline worktree)"),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 5 --baseline bea881c --out "
    "/tmp/bench-chain9": _measurement("2 minutes, twice with its baseline"),
    "python -m benchmarks.bench_stage1_state --rounds 15 --out benchmarks/results": _measurement(
        "40 s (full-size SDXL and FLUX built on meta)"
    ),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 3 --baseline HEAD --out "
    "benchmarks/results": _measurement("70 s, twice with its baseline worktree"),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux --rounds 3 --baseline 7461967 --out "
    "benchmarks/results": _measurement("minutes (SDXL and Flux sizes, with a baseline worktree)"),
    "python -m benchmarks.bench_plan_scale --cases sdxl --rounds 5 --baseline 7461967 --out "
    "benchmarks/results": _measurement("minutes (SDXL size, with a baseline worktree)"),
    "python -m benchmarks.bench_calls_overhead --rounds 40 --out benchmarks/results": _measurement(
        "15 s"
    ),
    "python -m benchmarks.bench_calls_overhead --rounds 60 --out benchmarks/results": _measurement(
        "25 s"
    ),
    "python -m benchmarks.bench_calls_overhead --cases kd --rounds 300 --out benchmarks/results": (
        _measurement("12 s")
    ),
    "python -m benchmarks.bench_calls_overhead --cases kd --rounds 2000 --out "
    "benchmarks/results": _measurement("20 s"),
    "python -m benchmarks.bench_cache_overlap --rounds 15 --out benchmarks/results": _measurement(
        "80 s"
    ),
    "python -m benchmarks.bench_calls_overhead --cases kd kd-wide --rounds 600 --out "
    "benchmarks/results": _measurement("minutes (600 rounds of a 10 ms step)"),
    "python -m benchmarks.bench_calls_overhead --cases sd --rounds 40 --out benchmarks/results": (
        _measurement("15 s")
    ),
    "python -m benchmarks.bench_calls_overhead --cases sd kd --rounds 40 --out "
    "benchmarks/results": _measurement("15 s, once per version compared"),
    "python -m benchmarks.bench_calls_overhead --cases sd --rounds 30 --recompute auto --out "
    "benchmarks/results": _measurement("15 s, once per setting compared"),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 5 --baseline 6108010 --out "
    "benchmarks/results": _measurement("2 minutes, with its baseline worktree"),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux --rounds 3 --baseline 6108010 --out "
    "benchmarks/results": _measurement("3 minutes (SDXL and Flux sizes, with a baseline worktree)"),
    "python -m benchmarks.bench_plan_scale --cases sdxl --rounds 5 --baseline 72d9ca5 --out "
    "benchmarks/results": _measurement("3 minutes (SDXL size, with a baseline worktree)"),
    "python -m benchmarks.flow_profile --nodes 10000 --repeat 3": _measurement("20 s"),
    "python -m benchmarks.bench_row_pairing --rounds 9 --out benchmarks/results": _measurement(
        "40 s"
    ),
    "python -m benchmarks.fork_profile --cases sd kd --rounds 30": _measurement("1 min"),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 3 --repeated 4 --baseline "
    "../wt-gcchain-base --out benchmarks/results": _measurement(
        "4 minutes, with a baseline worktree"
    ),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux --rounds 3 --baseline "
    "../wt-gcchain-base --out benchmarks/results": _measurement(
        "6 minutes (SDXL and Flux sizes, with a baseline worktree)"
    ),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 5 --baseline "
    "../wt-gcchain-base --out benchmarks/results": _measurement(
        "3 minutes, with a baseline worktree"
    ),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 4 --repeated 3 --baseline "
    "../wt-gcchain-base --out benchmarks/results": _measurement(
        "4 minutes, with a baseline worktree"
    ),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 3 --repeated 3 --baseline "
    "../wt-gcchain-base --out benchmarks/results": _measurement(
        "3 minutes, with a baseline worktree"
    ),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux --rounds 2 --baseline "
    "../wt-gcchain-base --out benchmarks/results": _measurement(
        "2 minutes (SDXL and Flux sizes, with a baseline worktree)"
    ),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 3 --repeated 3 --out "
    "/tmp/bench-q": _measurement("1 minute"),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 3 --baseline ../wt-base-e688 "
    "--out /tmp/bench-q2": _measurement("2 minutes, with a baseline worktree"),
    "python -m benchmarks.bench_split_scale --sizes 10000 --rounds 5 --baseline ../wt-base "
    "--out /tmp/bench-chain": _measurement("4 minutes, with a baseline worktree"),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux --rounds 3 --baseline ../wt-base "
    "--out /tmp/bench-plan": _measurement("3 minutes, with a baseline worktree"),
    "python -m benchmarks.bench_plan_scale --cases sdxl --rounds 4 --baseline ../wt-nowrites "
    "--out /tmp/bench-plan2": _measurement("2 minutes, with a baseline worktree"),
    "python -m benchmarks.bench_plan_scale --cases sdxl flux --rounds 4 --baseline ../wt-base "
    "--out /tmp/bench-plan3": _measurement("4 minutes, with a baseline worktree"),
    "python -m benchmarks.bench_trainer_live --out benchmarks/results": _measurement("minutes"),
    "python -m benchmarks.bench_trainer_live --samples 256 --teacher 512 --out "
    "benchmarks/results/big": _measurement("minutes"),
    "python -m benchmarks.bench_trainer_live --samples 128 --student 128 --teacher 1024 "
    "--rounds 8 --out benchmarks/results/xl": _measurement("minutes"),
    "python -m benchmarks.bench_trainer_live --samples 256 --student 256 --teacher 2048 "
    "--rounds 12 --out /tmp/live_big12": _measurement("3 minutes"),
    "python -m benchmarks.bench_lm_lengths --baseline 6e58338 --rounds 3 --out /tmp/lm_lengths": (
        _measurement("40 s, with a baseline exported from git")
    ),
    "python -m benchmarks.bench_lm_lengths --arch opt --baseline 6c7f3e5 --rounds 3 --out "
    "/tmp/lm_lengths": (_measurement("45 s, with a baseline exported from git")),
    "python -m benchmarks.bench_lm_lengths --arch bart --baseline 6c7f3e5 --rounds 3 --out "
    "/tmp/lm_lengths": (_measurement("40 s, with a baseline exported from git")),
    "python -m benchmarks.gpu --out benchmarks/results": "needs a CUDA device (its --dry-run, "
    "on the line below, runs here)",
    "python -m benchmarks.bench_field_bytes --baseline integration-wip --out /tmp/fb_full": (
        _measurement("5 minutes (SDXL's CLIP encoders at full width and depth)")
    ),
}
# A documented absolute output folder, replaced by one in the command's own folder so that the
# suite writes nothing outside its temporary folders.
OUTSIDE_FOLDERS = {"/tmp/results": "results"}
# Words that start a shell command: an unlabelled block starting with one is an error.
_SHELL_WORDS = re.compile(r"^(graphsplit|python3?|make|pip|accelerate|torchrun|aws|hf)(\s|$)")
_FENCE = re.compile(r"^```(?P<language>[\w-]*)\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Command:
    """One documented command: where it is and its words."""

    page: str
    line: int
    words: tuple[str, ...]

    @property
    def text(self) -> str:
        return shlex.join(self.words)


def _commands(page: str, start: int, body: str) -> list[Command]:
    """The commands of one bash block whose body starts on line ``start``."""
    commands, pending, first = [], "", None
    for offset, line in enumerate(body.splitlines()):
        first = start + offset if first is None else first
        if line.rstrip().endswith("\\"):  # a continued line: join it to the next
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        if words:
            commands.append(Command(page, first, tuple(words)))
        pending, first = "", None
    return commands


def _blocks() -> list[tuple[str, int, list[Command]]]:
    """``(page, line, commands)`` of every bash block, in page order."""
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for match in _FENCE.finditer(text):
            if match["language"] == "bash":
                line = text.count("\n", 0, match.start()) + 1
                found.append((page, line, _commands(page, line + 1, match["body"])))
    return found


BLOCKS = _blocks()


def _to_run(commands: list[Command], earlier: set[str]) -> list[Command]:
    return [c for c in commands if c.text not in NOT_RUN and c.text not in earlier]


def _block_params() -> list:
    params, earlier = [], set()
    for page, line, commands in BLOCKS:
        runs = _to_run(commands, earlier)
        earlier |= {command.text for command in commands}
        # The example spec builds and splits a tiny SD LoRA step: about 9 s a command.
        slow = sum("examples/sd_spec.py" in command.text for command in runs) >= 2
        marks = [pytest.mark.slow] if slow else []
        params.append(pytest.param(commands, runs, id=f"{page}:{line}", marks=marks))
    return params


# -- what the pages hold --------------------------------------------------------------------------
def test_the_pages_shell_blocks_are_found():
    pages = {page for page, _, _ in BLOCKS}
    assert {"README.md", "docs/index.md", "docs/howto.md", "docs/benchmarks.md"} <= pages
    texts = {command.text for _, _, commands in BLOCKS for command in commands}
    assert "graphsplit check-cache s3://my-bucket/sd-lora/cache" in texts
    assert "graphsplit --version" in texts


def test_every_command_not_run_is_still_documented():
    texts = {command.text for _, _, commands in BLOCKS for command in commands}
    stale = sorted(set(NOT_RUN) - texts)
    assert not stale, f"NOT_RUN names commands no page shows any more: {stale}"


def test_no_unlabelled_block_holds_a_shell_command():
    unlabelled = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for match in _FENCE.finditer(text):
            body = match["body"].lstrip()
            if not match["language"] and _SHELL_WORDS.match(body):
                unlabelled.append(f"{page}:{text.count(chr(10), 0, match.start()) + 1}")
    assert not unlabelled, f"label these blocks ```bash so that they run: {unlabelled}"


def test_the_commands_are_read_as_a_shell_reads_them():
    body = "graphsplit cache a.py:step \\\n  --out 'x y/'   # a note\n            # its sequel\n"
    (command,) = _commands("page.md", 3, body)
    assert command.words == ("graphsplit", "cache", "a.py:step", "--out", "x y/")
    assert command.line == 3 and command.text == "graphsplit cache a.py:step --out 'x y/'"


# -- running them ---------------------------------------------------------------------------------
def _environment(folder: Path) -> dict[str, str]:
    """``PATH`` with this interpreter's ``bin`` first (and a ``graphsplit`` if it has none)."""
    paths = [str(Path(sys.executable).parent)]
    if not (Path(sys.executable).parent / "graphsplit").exists():
        stand_in = folder / ".bin" / "graphsplit"
        stand_in.parent.mkdir()
        stand_in.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m graphsplit "$@"\n')
        stand_in.chmod(0o755)
        paths.insert(0, str(stand_in.parent))
    python_path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        **os.environ,
        "PATH": os.pathsep.join([*paths, os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(python_path),
        "OMP_NUM_THREADS": "1",
    }


def _buckets(commands: list[Command]) -> list[str]:
    return sorted(
        {urlparse(word).netloc for c in commands for word in c.words if word.startswith("s3://")}
    )


@pytest.mark.parametrize(("commands", "runs"), _block_params())
def test_every_shell_command_runs(commands, runs, tmp_path):
    for command in commands:
        if command.text in NOT_RUN and command.words[:2] == ("python", "-m"):
            _parse_only(command)
    if not runs:
        return
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    server = None
    if _buckets(runs):
        pytest.importorskip("moto.server")
        pytest.importorskip("s3fs")
        from tests.caching.s3_server import LocalS3

        server = LocalS3(*_buckets(runs))  # this process's AWS endpoint and keys; empty buckets
    try:
        environment = _environment(tmp_path)
        for command in runs:
            words = [OUTSIDE_FOLDERS.get(word, word) for word in command.words]
            done = subprocess.run(
                words, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, (
                f"{command.page}:{command.line}: `{command.text}` exited {done.returncode}\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
    finally:
        if server is not None:
            server.stop()


class _Parsed(Exception):
    """Raised by the patched parser once a benchmark's arguments parsed: nothing runs."""


def _parse_only(command: Command) -> None:
    """The benchmark's own ``main`` parses the documented arguments (and then stops)."""
    module = importlib.import_module(command.words[2])
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        with pytest.raises(_Parsed):
            module.main(list(command.words[3:]))
    except SystemExit as exit:  # argparse refused the documented arguments
        pytest.fail(f"{command.page}:{command.line}: `{command.text}` is refused ({exit})")
    finally:
        argparse.ArgumentParser.parse_args = original
