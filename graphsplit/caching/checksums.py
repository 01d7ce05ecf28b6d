"""The checksums that say a cache file still holds the bytes graphsplit wrote.

A checksum is written ``"algorithm:hex"``. graphsplit writes ``crc32`` (zlib's CRC-32, 8 hex
digits) and still reads ``sha256`` (64 hex digits), which caches of cache format 1 recorded.

Why CRC-32: the checksum guards against accidental damage (a torn copy, bit rot, a stray
write), not against someone forging a shard: a file's size, its tensor header and the sample
keys written inside it are checked separately, and nothing graphsplit reads is trusted to be
safe because of its checksum (it never unpickles). For that job CRC-32 detects every change
confined to 32 consecutive bits and every 1- or 2-bit error in files below 512 MiB with
certainty, and any other random damage with probability 1 - 2^-32; it runs at about 3 GB/s
on one core (zlib, with the GIL released), against about 1 GB/s for sha256, so hashing a
shard while it is written costs a third of the write instead of as much again.

In and out::

    Running(algorithm=ALGORITHM).update(buffer) ; .checksum() -> "crc32:1a2b3c4d"
    of_buffer(buffer, algorithm) -> str
    algorithm_of(checksum) -> "crc32" | "sha256"
"""

from __future__ import annotations

import hashlib
import re
import zlib
from typing import Any

__all__ = ["ALGORITHM", "CHECKSUM", "CHECKSUM_MEANING", "Running", "algorithm_of", "of_buffer"]

ALGORITHM = "crc32"
CHECKSUM = re.compile(r"crc32:[0-9a-f]{8}|sha256:[0-9a-f]{64}")
CHECKSUM_MEANING = "'crc32:' + 8 or 'sha256:' + 64 lowercase hex digits"


class Running:
    """A checksum fed piece by piece (``update`` releases the GIL on large buffers)."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        self.algorithm = algorithm
        self._crc = 0
        self._sha: Any = hashlib.sha256() if algorithm == "sha256" else None
        if algorithm not in ("crc32", "sha256"):
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")

    def update(self, data: Any) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def checksum(self) -> str:
        if self._sha is not None:
            return "sha256:" + self._sha.hexdigest()
        return f"crc32:{self._crc:08x}"


def of_buffer(data: Any, algorithm: str = ALGORITHM) -> str:
    """The checksum of a bytes-like object."""
    running = Running(algorithm)
    running.update(data)
    return running.checksum()


def algorithm_of(checksum: str) -> str:
    """``"crc32"`` for ``"crc32:1a2b3c4d"``."""
    return checksum.partition(":")[0]
