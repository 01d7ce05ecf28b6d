"""``Split.report()`` (``graphsplit.report``): boundary, parameters per stage, moved work."""

from __future__ import annotations

from tests.helpers import (
    batch,
    line_of,
    split_and_verify,
)
from tests.planning.test_cut import FrozenChain


# -- the report --------------------------------------------------------------------------------
def test_report_lists_boundary_parameters_and_moved_work():
    model = FrozenChain()
    split = split_and_verify(model, (batch(3, 8), batch(3, 1, seed=1)))
    report = split.report()
    assert report.startswith("graphsplit plan for FrozenChain")
    assert "Boundary: 2 tensors, 28 B per sample" in report
    row = next(line for line in report.splitlines() if line.strip().startswith("second "))
    assert "(3, 6)" in row and "float32" in row and "24 B" in row
    assert row.rstrip().endswith(line_of(FrozenChain.forward, "self.second("))
    assert "stage 1: 4 tensors" in report and "(0 trainable, 4 frozen)" in report
    assert "stage 2: 2 tensors" in report and "(2 trainable, 0 frozen)" in report
    assert "frozen parameters stage 2 does not need: 4 tensors" in report
    # first: 2*8*16 FLOPs per sample, second: 2*16*6
    assert "448 FLOP per sample" in report
