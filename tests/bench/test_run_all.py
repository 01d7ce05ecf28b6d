"""`make bench` runs every benchmark script, small by default and at full size with --full."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from benchmarks import run_all


def test_run_all_covers_every_benchmark_script_at_both_sizes(tmp_path):
    scripts = {
        f"benchmarks.{path.stem}" for path in (Path(run_all.__file__).parent).glob("bench_*.py")
    }
    for full in (False, True):
        steps = run_all.plan(full, tmp_path)
        assert {module for _, module, _ in steps} == scripts
        for _, module, argv in steps:
            assert importlib.util.find_spec(module) is not None
            assert argv[-2:] == ["--out", str(tmp_path)]
    small = dict((module, argv) for _, module, argv in run_all.plan(False, tmp_path))
    assert "--full" not in small["benchmarks.bench_split_scale"]
    # The timing scripts run their smoke-test size; cache bytes has no timing to shorten.
    quick = {module for module, argv in small.items() if "--quick" in argv}
    assert quick == scripts - {"benchmarks.bench_cache_bytes"}
