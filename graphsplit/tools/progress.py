"""Progress of ``graphsplit cache`` where no one watches a terminal: one plain line at a time.

``graphsplit.cache(progress=...)`` draws a tqdm bar, which tqdm hides when stderr is not a
terminal, so a Slurm or CI log shows nothing for the whole run. The command line therefore asks
``cache`` for the bar anyway and catches what tqdm writes: tqdm redraws its bar by writing
``"\\r" + status``; :class:`LineLog` keeps the newest status and writes it as one ordinary
line at most every ``interval`` seconds (plus the first and the last), so the log reads::

    caching:  40%|####      | 4/10 [00:02<00:03, 1.9sample/s, 1.2 MiB written]

Everything else written to stderr meanwhile (warnings) passes through unchanged.

In and out::

    line_log(interval, stream=sys.stderr) -> context manager; stderr goes through a LineLog
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["LineLog", "line_log"]


class LineLog:
    """A text stream for tqdm: each redraw replaces the pending status line; a status line is
    written out when ``interval`` seconds passed since the last one, and when the bar ends."""

    def __init__(self, stream: TextIO, interval: float) -> None:
        self.stream = stream
        self.interval = interval
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

    def _emit(self, now: float | None = None) -> None:
        if self._pending:
            self.stream.write(self._pending + "\n")
            self.stream.flush()
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


@contextlib.contextmanager
def line_log(interval: float, stream: TextIO | None = None) -> Iterator[LineLog]:
    """Send ``sys.stderr`` through a :class:`LineLog` for the duration of the block."""
    log = LineLog(stream if stream is not None else sys.stderr, interval)
    with contextlib.redirect_stderr(log):  # type: ignore[type-var]
        try:
            yield log
        finally:
            log.close()
