"""benchmarks/common.py: tables, result files, memory readings and the child-process protocol."""

from __future__ import annotations

import json

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
