"""Progress of ``graphsplit cache`` where no one watches a terminal: one plain line at a time.

``graphsplit.cache(progress=...)`` draws a tqdm bar, which tqdm hides when stderr is not a
terminal, so a Slurm or CI log shows nothing for the whole run. The command line therefore asks
``cache`` for the bar anyway and catches what tqdm writes: tqdm redraws its bar by writing
``"\\r" + status``; :class:`LineLog` keeps the newest status and writes it as one ordinary
line at most every ``interval`` seconds (plus the first and the last), so the log reads::

    caching:  40%|####      | 4/10 [00:02<00:03, 1.9sample/s, 1.2 MiB written]

Everything else written to stderr meanwhile (warnings) passes through unchanged.

Under ``accelerate launch`` (``WORLD_SIZE`` > 1, accelerate's state started) the status lines
go through accelerate's logger (``accelerate.logging.get_logger("graphsplit.cache")``) with
``main_process_only=True``: one process reports, not N interleaved bars. The logger writes to
the same stream, at INFO, through a handler this block adds and removes.

In and out::

    line_log(interval, stream=sys.stderr) -> context manager; stderr goes through a LineLog
    accelerate_emitter(stream) -> (emit, close) or None   None: not under a multi-process launch
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from graphsplit.tools.launch import world_size

__all__ = ["LOGGER_NAME", "LineLog", "accelerate_emitter", "line_log"]

LOGGER_NAME = "graphsplit.cache"


class LineLog:
    """A text stream for tqdm: each redraw replaces the pending status line; a status line is
    written out when ``interval`` seconds passed since the last one, and when the bar ends."""

    def __init__(
        self, stream: TextIO, interval: float, emit: Callable[[str], None] | None = None
    ) -> None:
        self.stream = stream
        self.interval = interval
        self._emit_line = emit if emit is not None else self._write_line
        self._pending = ""
        self._last: float | None = None
        self._lock = threading.Lock()  # tqdm and warnings may write from different threads

    def write(self, text: str) -> int:
        with self._lock:
            if "\r" not in text:
                if text.strip() == "" and self._last is not None:  # tqdm ends its bar: "\n"
                    self._emit()
                elif text:
                    self.stream.write(text)
                return len(text)
            self._pending = text.rsplit("\r", 1)[1].rstrip()
            now = time.monotonic()
            if self._last is None or now - self._last >= self.interval:
                self._emit(now)
            return len(text)

    def _write_line(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def _emit(self, now: float | None = None) -> None:
        if self._pending:
            self._emit_line(self._pending)
        self._pending = ""
        self._last = time.monotonic() if now is None else now

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        """Write the last status if tqdm did not end its line (an error stopped the run)."""
        with self._lock:
            if self._pending:
                self._emit()


def accelerate_emitter(stream: TextIO) -> tuple[Callable[[str], None], Callable[[], None]] | None:
    """``(emit, close)`` sending status lines through accelerate's logger on the main process,
    or None when not under a multi-process launch (or accelerate's state is not started, as
    before ``Accelerator()``: its logger refuses to log then)."""
    if world_size() <= 1:
        return None
    try:
        from accelerate.logging import get_logger
        from accelerate.state import PartialState
    except ImportError:
        return None
    if not PartialState._shared_state:  # accelerate's own "is the state initialised" test
        return None
    adapter = get_logger(LOGGER_NAME, log_level="INFO")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    base = logging.getLogger(LOGGER_NAME)
    base.addHandler(handler)
    propagate, base.propagate = base.propagate, False  # once, not again by a root handler

    def emit(line: str) -> None:
        adapter.info(line, main_process_only=True)
        handler.flush()

    def close() -> None:
        base.removeHandler(handler)
        base.propagate = propagate

    return emit, close


@contextlib.contextmanager
def line_log(interval: float, stream: TextIO | None = None) -> Iterator[LineLog]:
    """Send ``sys.stderr`` through a :class:`LineLog` for the duration of the block; under a
    multi-process ``accelerate launch`` its lines go through accelerate's logger."""
    stream = stream if stream is not None else sys.stderr
    through = accelerate_emitter(stream)
    log = LineLog(stream, interval, None if through is None else through[0])
    with contextlib.redirect_stderr(log):  # type: ignore[type-var]
        try:
            yield log
        finally:
            log.close()
            if through is not None:
                through[1]()
