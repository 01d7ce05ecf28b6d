"""The command line: inspect on a tiny spec, spec loading errors, check-cache, --help."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphsplit.cli import main
from graphsplit.spec import SpecError, StepSpec, load_spec

SPEC_FILE = Path(__file__).parent / "specs" / "tiny_step.py"


def test_inspect_prints_report_and_writes_code_and_picture(tmp_path, capsys):
    code = main(["inspect", f"{SPEC_FILE}:step", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "graphsplit plan for TinyStep" in out
    assert "Boundary" in out
    for name in ("stage1.py", "stage2.py", "plan.json", "split.dot", "split.html"):
        assert (tmp_path / name).is_file(), name
    assert "def forward" in (tmp_path / "stage2.py").read_text()
    assert json.loads((tmp_path / "plan.json").read_text())


def test_inspect_accepts_a_module_spec(tmp_path, capsys):
    assert main(["inspect", "tests.specs.tiny_step:step", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "split.html").is_file()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "is not a step spec"),
        ("tests/specs/does_not_exist.py:step", "no such file"),
        ("graphsplit_no_such_module:step", "cannot import module"),
        (f"{SPEC_FILE}:missing", "has no function 'missing'"),
        (f"{SPEC_FILE}:not_a_spec", "not a graphsplit.spec.StepSpec"),
        (f"{SPEC_FILE}:raises", "RuntimeError: boom"),
    ],
)
def test_bad_specs_exit_2_with_a_message(spec, message, tmp_path, capsys):
    assert main(["inspect", spec, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    with pytest.raises(SpecError, match="fix"):
        load_spec(spec)


def test_load_spec_returns_step_spec():
    spec = load_spec(f"{SPEC_FILE}:step")
    assert isinstance(spec, StepSpec)
    assert spec.example_kwargs == {}
    assert len(spec.example_args) == 2


def test_check_cache_on_a_folder_without_cache_fails(tmp_path, capsys):
    assert main(["check-cache", str(tmp_path)]) == 1
    assert "manifest.json" in capsys.readouterr().out


def test_bad_spec_in_a_subprocess_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "graphsplit", "inspect", f"{SPEC_FILE}:missing"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "has no function" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["check-cache", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: graphsplit" in out


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "inspect", "check-cache"):
        assert command in out


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect"])
    assert exit_info.value.code == 2
