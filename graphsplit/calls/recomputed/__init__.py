"""Stage 2 redoes a cached frozen layer where that costs less than storing its output
(``recompute="auto"``); see :mod:`.layers`."""

from graphsplit.calls.recomputed.layers import Redone, redone_calls

__all__ = ["Redone", "redone_calls"]
