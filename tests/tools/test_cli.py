"""The command line: inspect and cache on a tiny spec, exit codes, check-cache, --help."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphsplit.tools.cli import main
from tests.helpers import free_port
from tests.tools.specs import BAD_SPECS, TINY_STEP


def test_inspect_prints_report_and_writes_code_and_picture(tmp_path, capsys):
    code = main(["inspect", f"{TINY_STEP}:step", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "graphsplit plan for TinyStep" in out
    assert "Boundary" in out
    for name in ("stage1.py", "stage2.py", "plan.json", "split.dot", "split.html"):
        assert (tmp_path / name).is_file(), name
    assert "def forward" in (tmp_path / "stage2.py").read_text()
    assert json.loads((tmp_path / "plan.json").read_text())


def test_inspect_accepts_a_module_spec(tmp_path, capsys):
    assert main(["inspect", "tests.tools.specs.tiny_step:step", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "split.html").is_file()


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS)
def test_bad_specs_exit_2_with_a_message(spec, message, tmp_path, capsys):
    assert main(["inspect", spec, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_check_cache_on_a_folder_without_cache_fails(tmp_path, capsys):
    assert main(["check-cache", str(tmp_path)]) == 1
    assert "manifest.json" in capsys.readouterr().out


def test_bad_spec_in_a_subprocess_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "graphsplit", "inspect", f"{TINY_STEP}:missing"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "has no function" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["inspect", "--help"],
        ["cache", "--help"],
        ["check-cache", "--help"],
        ["export", "--help"],
    ],
)
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
    for command in ("inspect", "cache", "check-cache", "export"):
        assert command in out


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect"])
    assert exit_info.value.code == 2


def test_cache_command_writes_a_cache_that_checks_ok(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(out)]) == 0
    assert "10 samples" in capsys.readouterr().out
    assert main(["check-cache", str(out)]) == 0
    assert "OK (10 samples" in capsys.readouterr().out


def test_check_cache_on_a_corrupt_cache_exits_1_and_names_the_shard(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(out)]) == 0
    shard = next(out.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["check-cache", str(out)]) == 1
    assert shard.name in capsys.readouterr().out


def test_cache_command_needs_a_dataset(tmp_path, capsys, monkeypatch):
    spec_file = tmp_path / "no_dataset.py"
    spec_file.write_text(
        "import torch\nfrom graphsplit import StepSpec\n"
        "def step():\n"
        "    return StepSpec(torch.nn.Linear(2, 1), example_args=(torch.randn(3, 2),))\n"
    )
    assert main(["cache", f"{spec_file}:step", "--out", str(tmp_path / "c")]) == 2
    error = capsys.readouterr().err
    assert "without a dataset" in error and "fix:" in error


def test_cache_command_on_a_bad_spec_exits_2(tmp_path, capsys):
    assert main(["cache", f"{TINY_STEP}:missing", "--out", str(tmp_path / "c")]) == 2
    assert "has no function" in capsys.readouterr().err


def test_cache_command_under_accelerate_launch_with_two_processes(tmp_path):
    pytest.importorskip("accelerate")
    import os

    out = tmp_path / "cache"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    launch += ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    launch += ["--dynamo_backend", "no", "--main_process_port", str(free_port())]
    command = [*launch, "-m", "graphsplit", "cache", f"{TINY_STEP}:step", "--out", str(out)]
    command += ["--batch-size", "2", "--shard-bytes", "60"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("ACCELERATE_CONFIG_FILE", None)
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("graphsplit cache at") == 1  # printed by the main process only
    # off a terminal, progress goes through accelerate's logger, from the main process only
    status = [line for line in result.stderr.splitlines() if "caching (process" in line]
    assert status and all(line.startswith("[RANK 0] caching (process 0 of 2):") for line in status)
    assert main(["check-cache", str(out)]) == 0
    assert len(list(out.glob("shard-*.safetensors"))) > 1  # both processes wrote shards
