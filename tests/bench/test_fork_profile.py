"""benchmarks/fork_profile.py times the module-level path's stage 1 under three forks."""

from __future__ import annotations

import json

from benchmarks.fork_profile import main


def test_the_command_prints_a_ratio_per_fork_and_clock(capsys):
    assert main(["--cases", "kd", "--rounds", "2"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["case"] == "kd" and row["rounds"] == 2
    for name in ("known", "watched"):
        for clock in ("cpu", "wall"):
            ratio = row[f"{name}_over_globals_{clock}"]
            assert ratio["count"] == 2 and ratio["q1"] <= ratio["median"] <= ratio["q3"]
