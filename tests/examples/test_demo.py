"""The README's first command, at a reduced size: split, cache, train both ways, compare."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from examples.demo import main


def test_demo_prints_the_side_by_side_table_with_equal_losses(capsys):
    code = main(
        [
            "--size",
            "tiny",
            "--resolution",
            "32",
            "--samples",
            "4",
            "--batch-size",
            "2",
            "--steps",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "graphsplit plan for SDLoRAStep" in out and "4 samples in" in out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines() if "loss, step" in line}
    assert set(rows) == {"loss, step 1", "loss, step 2"}
    for cells in rows.values():
        assert cells[-1] == cells[-2]  # unsplit and stage 2 print the same loss
    for label in ("step time", "weights held", "peak RSS", "cache on disk"):
        assert label in out
    assert "losses equal bit for bit" in out
