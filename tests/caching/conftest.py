"""Fixtures shared by the cache tests: the hand-made split, and one cache built per module."""

from __future__ import annotations

import pytest

from graphsplit.caching.write.cache_run import cache
from tests.caching.fixtures import SMALL, Pictures, loader, make_split
from tests.caching.s3_server import bucket, s3, s3_endpoint  # noqa: F401 (fixtures)


@pytest.fixture
def split():
    return make_split()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One cache of 12 samples in 6 shards, built once; tests copy it before damaging it."""
    path = tmp_path_factory.mktemp("cache")
    cache(make_split(), loader(Pictures(12)), path, shard_bytes=SMALL, progress=False)
    return path


@pytest.fixture
def path(built, tmp_path):
    """A copy of the module's cache, for a test to read or damage."""
    copy = tmp_path / "cache"
    copy.mkdir()
    for entry in built.iterdir():
        (copy / entry.name).write_bytes(entry.read_bytes())
    return copy
