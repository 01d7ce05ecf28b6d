"""Every frame of graphsplit is internal, not only those under graphsplit/planning/.

A traced op reached through graphsplit's own code outside planning (the module-level path's
routed forwards in graphsplit/calls/, api.py) must never be named as the user's line.
"""

from __future__ import annotations

import graphsplit
import graphsplit.api
import graphsplit.caching.write.cache_run
import graphsplit.calls.module_calls
from graphsplit.planning.rules import user_lines


def test_frames_anywhere_in_the_package_are_internal():
    for module in (
        graphsplit,
        graphsplit.api,
        graphsplit.calls.module_calls,
        graphsplit.caching.write.cache_run,
        user_lines,
    ):
        assert user_lines.is_internal(module.__file__), module.__name__


def test_a_user_file_beside_the_package_is_not_internal(tmp_path):
    assert not user_lines.is_internal(__file__)
    assert not user_lines.is_internal(str(tmp_path / "train.py"))
