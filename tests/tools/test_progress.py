"""Progress off a terminal: under ``accelerate launch`` the status lines go through accelerate's
logger, from the main process only; without a launch they are plain lines on the stream."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from graphsplit.tools.progress import LOGGER_NAME, accelerate_emitter, line_log


def _bar(steps: int) -> None:
    for step in range(steps + 1):
        sys.stderr.write(f"\rcaching: {step}/{steps}")
    sys.stderr.write("\n")


@pytest.fixture
def accelerate_state(monkeypatch):
    """accelerate's state started for one process, while WORLD_SIZE says 2 (as in a launch)."""
    state = pytest.importorskip("accelerate.state", reason="accelerate is not installed")
    state.PartialState._reset_state()
    state.PartialState(cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    yield state.PartialState
    state.PartialState._reset_state()


def test_without_a_launch_lines_go_to_the_stream():
    assert accelerate_emitter(io.StringIO()) is None
    stream = io.StringIO()
    with line_log(0.0, stream):
        _bar(3)
        sys.stderr.write("a warning\n")
    assert stream.getvalue() == (
        "caching: 0/3\ncaching: 1/3\ncaching: 2/3\ncaching: 3/3\na warning\n"
    )


def test_under_a_launch_the_main_process_logs_through_accelerate(accelerate_state):
    stream = io.StringIO()
    records = []
    recorder = logging.Handler()
    recorder.emit = records.append
    logging.getLogger(LOGGER_NAME).addHandler(recorder)
    try:
        with line_log(3600.0, stream):
            _bar(4)
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(recorder)
    # first and last, once each, with accelerate's own "[RANK 0]" mark
    assert stream.getvalue() == "[RANK 0] caching: 0/4\n[RANK 0] caching: 4/4\n"
    assert [record.getMessage() for record in records] == [
        "[RANK 0] caching: 0/4",
        "[RANK 0] caching: 4/4",
    ]
    assert all(record.levelno == logging.INFO for record in records)
    assert logging.getLogger(LOGGER_NAME).handlers == []  # the block's handler is gone


def test_under_a_launch_other_processes_stay_quiet(accelerate_state, monkeypatch):
    monkeypatch.setattr(accelerate_state, "is_main_process", property(lambda self: False))
    stream = io.StringIO()
    with line_log(0.0, stream):
        _bar(2)
        sys.stderr.write("a warning\n")  # not a status line: every process still shows it
    assert stream.getvalue() == "a warning\n"
