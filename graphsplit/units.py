"""Sizes and counts for humans: the one place graphsplit formats bytes, FLOPs and key lists."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["human_bytes", "human_flops", "some_keys"]


def human_bytes(count: float) -> str:
    """``1536 -> "1.5 KiB"`` (binary units, as file managers and `du -h` show sizes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def human_flops(count: float) -> str:
    """``2.87e12 -> "2.87 TFLOP"`` (decimal units, as FLOP counts are quoted)."""
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(count) < 1000 or unit == "P":
            return f"{count:.3g} {unit}FLOP"
        count /= 1000
    raise AssertionError("unreachable")


def some_keys(keys: Sequence[str], limit: int = 5) -> str:
    """``["a", "b", "c"], 2 -> "'a', 'b' and 1 more"``: the first ``limit`` keys, quoted."""
    shown = ", ".join(repr(key) for key in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
