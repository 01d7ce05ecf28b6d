"""``graphsplit cache`` with the user's pipeline: loader, collate_fn, workers, storage dtype,
--verify, the plan first, the off-terminal progress log, CLI words in errors, --version."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphsplit.tools.cli import main
from graphsplit.tools.launch import LaunchError, check_launch
from graphsplit.tools.progress import LineLog
from graphsplit.version import __version__
from tests.tools.specs import DATA_SPECS, TINY_STEP, data_specs

ROOT = Path(__file__).resolve().parents[2]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"graphsplit {__version__} (torch ")


def test_cache_prints_the_plan_then_verifies_then_caches(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    plan = printed.index("graphsplit plan for TinyStep")
    verified = printed.index("verified on the first batch: 1 output(s) and 2 gradient(s)")
    done = printed.index("graphsplit cache at")
    assert plan < verified < done
    assert main(["check-cache", str(out)]) == 0


def test_verify_names_the_input_the_batch_lacks(tmp_path, capsys):
    spec = f"{DATA_SPECS}:missing_input"
    assert main(["cache", spec, "--out", str(tmp_path / "c"), "--verify"]) == 1
    error = capsys.readouterr().err
    assert "--verify: the first batch has no ['y']" in error and "fix:" in error
    assert not (tmp_path / "c").exists()  # nothing cached after a failed check


def test_off_terminal_progress_is_plain_lines(tmp_path, capsys):
    out = tmp_path / "cache"
    argv = ["cache", f"{TINY_STEP}:step", "--out", str(out), "--batch-size", "2"]
    assert main([*argv, "--log-interval", "0"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("caching")]
    assert "\r" not in err
    assert lines[0].startswith("caching:   0%") and "10/10" in lines[-1]
    assert len(lines) >= 6  # one per batch of 2 at interval 0, plus the first and the last


def test_line_log_keeps_first_and_last_status_within_the_interval():
    class Sink:
        text = ""

        def write(self, text):
            self.text += text

        def flush(self):
            pass

    sink = Sink()
    log = LineLog(sink, interval=3600.0)
    for status in ("\rcaching 0/3", "\rcaching 1/3", "\rcaching 2/3", "\rcaching 3/3"):
        log.write(status)
    log.write("a warning\n")
    log.write("\n")
    assert sink.text == "caching 0/3\na warning\ncaching 3/3\n"


def test_storage_dtype_flag_overrides_the_spec(tmp_path, capsys):
    spec = f"{DATA_SPECS}:with_bfloat16"
    assert main(["cache", spec, "--out", str(tmp_path / "bf16")]) == 0
    assert "stored as torch.bfloat16" in capsys.readouterr().out
    assert _manifest(tmp_path / "bf16")["storage_dtype"] == "bfloat16"
    assert main(["cache", spec, "--out", str(tmp_path / "f16"), "--storage-dtype", "float16"]) == 0
    assert _manifest(tmp_path / "f16")["storage_dtype"] == "float16"
    assert main(["cache", spec, "--out", str(tmp_path / "raw"), "--storage-dtype", "none"]) == 0
    assert _manifest(tmp_path / "raw")["storage_dtype"] is None


def test_the_specs_loader_is_used_as_it_is(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["cache", f"{DATA_SPECS}:with_loader", "--out", str(out)]) == 0
    assert "10 samples" in capsys.readouterr().out
    assert _manifest(out)["layout"]["batch_size"] == 5


@pytest.mark.parametrize("flags", [["--batch-size", "2"], ["--num-workers", "1"]])
def test_batching_flags_are_refused_with_a_loader(flags, tmp_path, capsys):
    argv = ["cache", f"{DATA_SPECS}:with_loader", "--out", str(tmp_path / "c"), *flags]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert f"{flags[0]} cannot change the loader" in error and "fix:" in error


def test_the_specs_collate_fn_batches_the_dataset(tmp_path, capsys):
    data_specs.COLLATED.clear()
    argv = ["cache", "tests.tools.specs.data_specs:with_collate", "--out", str(tmp_path / "c")]
    assert main([*argv, "--batch-size", "4"]) == 0
    assert sum(data_specs.COLLATED) >= 10 and 4 in data_specs.COLLATED


def test_num_workers_flag_loads_in_worker_processes(tmp_path, capsys):
    out = tmp_path / "cache"
    argv = ["cache", f"{TINY_STEP}:step", "--out", str(out), "--num-workers", "1"]
    assert main(argv) == 0
    assert main(["check-cache", str(out)]) == 0


def test_a_stale_cache_error_names_the_overwrite_flag(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["cache", f"{DATA_SPECS}:other_weights", "--out", str(out)]) == 1
    error = capsys.readouterr().err
    assert "StaleCacheError" in error and "pass --overwrite to replace it" in error
    assert "overwrite=True" not in error  # the typed remedy speaks the command line's words
    argv = ["cache", f"{DATA_SPECS}:other_weights", "--out", str(out), "--overwrite"]
    assert main(argv) == 0


class _SingleProcess:
    num_processes = 1

    class distributed_type:
        value = "NO"


def test_a_single_process_accelerator_under_world_size_2_is_refused():
    with pytest.raises(LaunchError) as raised:
        check_launch(2, _SingleProcess())
    message = str(raised.value)
    assert "WORLD_SIZE=2, but accelerate runs 1 process(es) (distributed type NO)" in message
    assert "accelerate launch --multi_gpu --num_processes 2" in message
    check_launch(1, _SingleProcess())  # one process: nothing to refuse


def test_world_size_2_without_a_process_group_exits_2_with_the_fix(tmp_path):
    pytest.importorskip("accelerate")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    for name in ("MASTER_ADDR", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_CONFIG_FILE"):
        env.pop(name, None)
    command = [sys.executable, "-m", "graphsplit", "cache", f"{TINY_STEP}:step"]
    command += ["--out", str(tmp_path / "c")]
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "WORLD_SIZE=2" in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "c").exists()
