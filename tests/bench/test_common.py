"""benchmarks/common.py: tables, result files, memory readings and the child-process protocol."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import common


def test_markdown_table_aligns_text_left_and_numbers_right():
    table = common.markdown_table(["case", "MiB"], [["tiny", 3], ["sdxl", 12]], "lr")
    assert table.splitlines() == ["| case | MiB |", "|---|---:|", "| tiny | 3 |", "| sdxl | 12 |"]


def test_write_results_writes_json_and_markdown(tmp_path, capsys):
    payload = common.report("demo", [{"x": 1}], common.environment("torch"))
    json_path, markdown_path = common.write_results(tmp_path / "out", "demo", payload, "| a |\n")
    assert json.loads(json_path.read_text())["results"] == [{"x": 1}]
    assert markdown_path.read_text() == "| a |\n"
    assert {"torch", "python", "platform", "cpus"} <= set(payload["environment"])
    assert "wrote" in capsys.readouterr().out


def test_memory_readings_are_positive_and_the_peak_bounds_the_current():
    assert common.peak_rss_bytes() >= common.current_rss_bytes() > 0
    assert common.python_heap_peak_bytes(lambda: bytearray(1 << 20)) >= 1 << 20
    assert common.mib(3 * 2**20) == 3.0


def test_run_child_reads_the_json_line_or_raises_child_failed(tmp_path):
    row = tmp_path / "row.json"
    row.write_text('{"case": "tiny", "max_rss_mib": 1.5}')
    # json.tool --compact prints the row as one line, as a benchmark's child does.
    reply = common.run_child("json.tool", ["--compact", str(row)])
    assert reply == {"case": "tiny", "max_rss_mib": 1.5}
    with pytest.raises(common.ChildFailed) as failed:
        common.run_child("benchmarks.no_such_module", [])
    assert failed.value.returncode != 0 and "No module named" in failed.value.tail


def test_parser_has_out_with_the_results_folder_default():
    options = common.parser("bench_x", "Title.\n\nMore.").parse_args([])
    assert options.out == common.RESULTS


def test_spread_is_the_median_and_inclusive_quartiles():
    assert common.spread([3.0, 1.0, 2.0, 5.0, 4.0]) == common.Spread(3.0, 2.0, 4.0, 5)
    assert common.spread([7.0]) == common.Spread(7.0, 7.0, 7.0, 1)
    assert str(common.spread([1.0, 2.0, 3.0])) == "2.000 (IQR 1.500–2.500, n=3)"
    with pytest.raises(ValueError, match="at least one"):
        common.spread([])


def test_interleaved_alternates_the_order_and_times_only_the_timed_rounds():
    calls = []
    variants = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    seen = []
    timings = common.interleaved(
        variants, rounds=3, warmup=1, before_each=lambda name, index: seen.append((name, index))
    )
    assert "".join(calls) == "abbaabba"  # round 0 is the warm-up
    assert seen[:4] == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    for clock in ("wall", "cpu"):
        assert [len(timings.seconds(name, clock)) for name in "ab"] == [3, 3]
        assert all(value >= 0 for value in timings.seconds("a", clock))


def test_ratio_pairs_seconds_of_the_same_round():
    # b is twice as slow as a in every round while the rounds themselves vary 10x: the
    # same-round ratio is exactly 0.5, the ratio of the medians would not be.
    timings = common.Timings(
        wall={"a": [1.0, 10.0, 1.0], "b": [2.0, 20.0, 2.0]},
        cpu={"a": [1.0, 1.0, 1.0], "b": [1.0, 1.0, 4.0]},
    )
    assert timings.ratio("a", "b") == common.Spread(0.5, 0.5, 0.5, 3)
    assert timings.ratio("a", "b", "cpu").median == 1.0
    assert timings.spread("a").median == 1.0
    assert timings.to_json()["cpu"]["b"]["seconds"] == [1.0, 1.0, 4.0]


def test_timing_options_default_to_one_thread_and_quick_off():
    options = common.timing_options(common.parser("bench_x", "T."), rounds=7).parse_args([])
    assert (options.threads, options.rounds, options.quick) == (1, 7, False)
    import torch

    before = torch.get_num_threads()
    with common.torch_threads(1) as count:
        assert count == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_baseline_code_swaps_only_graphsplit(tmp_path):
    package = tmp_path / "old" / "graphsplit"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("WHICH = 'old'\n")
    view = tmp_path / "view"
    view.mkdir()
    assert common.baseline_code(str(tmp_path / "old"), view) == view
    assert (view / "graphsplit").resolve() == package.resolve()
    for name in ("benchmarks", "tests"):
        assert (view / name).resolve() == common.REPOSITORY / name
    # A child started there imports the baseline's graphsplit and this checkout's benchmarks.
    probe = "import graphsplit, benchmarks.common as c; print(graphsplit.WHICH, c.REPOSITORY)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=view, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["old", str(common.REPOSITORY)]


def test_baseline_code_names_what_it_could_not_use(tmp_path):
    with pytest.raises(ValueError, match="neither a folder holding a graphsplit package nor"):
        common.baseline_code("no-such-revision-xyz", tmp_path)


def test_versus_baseline_alternates_and_pairs_rounds(tmp_path):
    calls = []

    def measure(code):
        calls.append("b" if code else "c")
        return (2.0, 1.0) if code else (1.0, 1.0)  # the current code is twice as fast

    timings = common.versus_baseline(measure, tmp_path, rounds=3)
    assert "".join(calls) == "cbbccb"
    assert timings.ratio("current", "baseline") == common.Spread(0.5, 0.5, 0.5, 3)
    assert timings.ratio("current", "baseline", "cpu").median == 1.0


def test_compare_with_baseline_reports_same_plan_only_when_every_digest_agrees(tmp_path):
    digests = iter(["a", "a", "a", "b"])

    def measure(code):
        return (2.0, 2.0, next(digests)) if code else (1.0, 1.0, next(digests))

    versus = common.compare_with_baseline(measure, tmp_path, rounds=2)
    assert versus["cpu_ratio"]["median"] == 0.5 and versus["rounds"] == 2
    assert versus["same_plan"] is False
    assert versus["digests"] == {"current": ["a", "b"], "baseline": ["a"]}
    table = common.baseline_table([("sdxl", {"baseline": "abc123", **versus})], "case")
    assert "Against the baseline abc123" in table
    row = "| sdxl | 2 | 2.00 | 1.00 | 0.500 (0.500–0.500) | 0.500 (0.500–0.500) | **no** |"
    assert row in table
