"""benchmarks/signature_profile.py classes a new plan's node runs by what the first plan ran:
a frozen text encoder fed the same tokens is met, an encoder fed a new width is not."""

from __future__ import annotations

from benchmarks.signature_profile import PARTS, main, new_plan_profile
from tests.planning.test_shared_memos import TextAndSizeBranch, _batch


def test_the_same_tokens_are_met_and_a_new_width_is_not():
    row = new_plan_profile(TextAndSizeBranch(), _batch(16, 0), _batch(12, 1))
    assert row["parts_by_target"]["text"] == ["met by the first plan"]
    assert row["parts_by_target"]["encoder"] == ["new to this plan"]
    assert set(row["seconds"]) == set(PARTS)
    assert abs(sum(row["seconds"].values()) - row["plan_s"]) < 1e-9
    assert 0 < row["reuse_ceiling"] < 1


def test_the_command_prints_one_json_line_per_repeat(capsys):
    assert main(["branch", "--repeat", "1"]) == 0
    assert capsys.readouterr().out.count('"reuse_ceiling"') == 1
