"""Fingerprints: what changes them, and what they need."""

from __future__ import annotations

import pytest

from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.fingerprint import differences, fingerprint
from graphsplit.errors import CacheError
from tests.caching.fixtures import Model, make_split, trace


def test_trace_time_sizes_do_not_change_the_fingerprint():
    split = make_split()
    other = make_split()
    spec = other.boundary["latents"]
    other.boundary["latents"] = BoundarySpec("latents", (7, 4, 9, 9), spec.dtype, 0, 1, "y:9")
    assert differences(fingerprint(split), fingerprint(other)) == ()


def test_fingerprint_needs_real_weights():
    split = make_split()
    split.stage1 = trace(Model().encoder.to("meta"))
    with pytest.raises(CacheError, match="on the meta device"):
        fingerprint(split)
