"""``graphsplit inspect`` on a step that falls back to the module-level path: the report and
plan.json, and no picture (a module-level split has no graph to draw)."""

import json

from graphsplit.tools.cli import main


def test_inspect_a_step_on_the_module_level_path(tmp_path, capsys):
    code = main(["inspect", "tests.calls.loop_spec:step", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "graphsplit plan for PerSampleLoop (module-level path)" in out
    assert "path: calls, because the whole-step trace refused the step" in out
    assert json.loads((tmp_path / "plan.json").read_text())["path"] == "calls"
    assert not (tmp_path / "split.html").exists()
