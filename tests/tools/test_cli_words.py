"""Errors carry a typed remedy; the CLI renders it as its flag, the Python API as its argument;
and ``graphsplit export`` writes a cache as a Hugging Face ``datasets`` dataset."""

from __future__ import annotations

import pickle

import pytest

from graphsplit.errors import (
    CacheError,
    Fix,
    GraphsplitError,
    Remedy,
    StaleCacheError,
    Wording,
    speaking,
    user_error,
)
from graphsplit.tools.cli import main
from tests.tools.specs import TINY_STEP


def test_a_remedy_renders_in_the_callers_words():
    fix = Fix("pass {remedy} to replace it, or choose another path", Remedy.OVERWRITE)
    error = user_error(StaleCacheError, "the folder holds another cache", fix=fix)
    assert error.remedy is Remedy.OVERWRITE and error.fix == fix
    assert error.reason == "the folder holds another cache"
    assert str(error).endswith("fix:    pass overwrite=True to replace it, or choose another path")
    assert error.args[0] == str(error)  # args hold the Python words, as code reading it expects
    with speaking(Wording.CLI):
        assert str(error).endswith("fix:    pass --overwrite to replace it, or choose another path")
        assert "overwrite=True" not in str(error)
    assert "overwrite=True" in str(error)  # the block restored the Python words


def test_a_bare_remedy_is_the_fix_pass_that_option():
    error = user_error(CacheError, "the workers cannot start", fix=Remedy.NUM_WORKERS_0)
    assert str(error).splitlines() == ["the workers cannot start", "  fix:    pass num_workers=0"]
    with speaking(Wording.CLI):
        assert str(error).splitlines()[-1] == "  fix:    pass --num-workers 0"


def test_a_fix_without_an_option_reads_the_same_in_both_words():
    error = user_error(CacheError, "no room", fix=Fix("free some disk space and resume"))
    assert error.remedy is None
    with speaking(Wording.CLI):
        assert str(error) == "no room\n  fix:    free some disk space and resume"
    assert str(error) == "no room\n  fix:    free some disk space and resume"


@pytest.mark.parametrize("remedy", list(Remedy))
def test_every_remedy_has_both_words(remedy):
    assert remedy.words(Wording.PYTHON) == remedy.python and "=" in remedy.python
    assert remedy.words(Wording.CLI) == remedy.cli and remedy.cli.startswith("--")


def test_a_message_without_the_slot_gets_the_flag_on_the_command_line():
    error = CacheError("the cache is stale.\n  fix: rebuild it", remedy=Remedy.OVERWRITE)
    assert str(error) == "the cache is stale.\n  fix: rebuild it"
    with speaking(Wording.CLI):
        assert str(error).endswith("\n  on the command line: --overwrite")


def test_a_subclass_remedy_and_plain_errors():
    class ExistsError(GraphsplitError):
        remedy = Remedy.OVERWRITE

    with speaking(Wording.CLI):
        assert str(ExistsError("fix: pass {remedy}")) == "fix: pass --overwrite"
        assert str(GraphsplitError("no remedy {here}")) == "no remedy {here}"
    assert GraphsplitError("x").remedy is None


def test_a_remedy_survives_pickling_for_worker_processes():
    error = StaleCacheError("fix: pass {remedy}", remedy=Remedy.STORE_BFLOAT16)
    back = pickle.loads(pickle.dumps(error))
    assert back.remedy is Remedy.STORE_BFLOAT16
    assert str(back) == "fix: pass storage_dtype=torch.bfloat16"
    with speaking(Wording.CLI):
        assert str(back) == "fix: pass --storage-dtype bfloat16"


# -- graphsplit export: the remedy end to end, in both words ----------------------------------


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "cache"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(out), "--log-interval", "60"]) == 0
    return out


def test_export_writes_a_dataset_and_refuses_to_replace_it_in_cli_words(
    tiny_cache, tmp_path, capsys
):
    datasets = pytest.importorskip("datasets", reason="the optional datasets package is missing")
    from graphsplit.caching.read.hf_export import HFCachedDataset, HFExportError, export_cache

    dest = tmp_path / "exported"
    assert main(["export", str(tiny_cache), "--out", str(dest)]) == 0
    assert f"to {dest}" in capsys.readouterr().out
    assert len(HFCachedDataset(datasets.load_from_disk(str(dest)))) == 10

    assert main(["export", str(tiny_cache), "--out", str(dest)]) == 1
    error = capsys.readouterr().err
    assert "already holds an exported dataset" in error
    assert "fix:    pass --overwrite to replace it" in error
    assert "overwrite=True" not in error and "Traceback" not in error

    with pytest.raises(HFExportError) as raised:  # the Python API says it in its own words
        export_cache(tiny_cache, dest)
    assert raised.value.remedy is Remedy.OVERWRITE
    assert "pass overwrite=True to replace it" in str(raised.value)

    assert main(["export", str(tiny_cache), "--out", str(dest), "--overwrite"]) == 0
    assert len(datasets.load_from_disk(str(dest))) == 10
    assert not (tmp_path / "exported.partial").exists()


def test_export_never_replaces_what_is_not_an_export(tiny_cache, tmp_path, capsys):
    pytest.importorskip("datasets", reason="the optional datasets package is missing")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["export", str(tiny_cache), "--out", str(mine), "--overwrite"]) == 1
    error = capsys.readouterr().err
    assert "is not a saved dataset graphsplit may replace" in error and "fix:" in error
    assert (mine / "notes.txt").read_text() == "keep me"


def test_export_to_parquet_streams_back(tiny_cache, tmp_path, capsys):
    datasets = pytest.importorskip("datasets", reason="the optional datasets package is missing")
    from graphsplit.caching.read.hf_export import HFCachedIterable

    dest = tmp_path / "cache.parquet"
    assert main(["export", str(tiny_cache), "--out", str(dest), "--parquet"]) == 0
    streamed = datasets.load_dataset("parquet", data_files=str(dest), split="train", streaming=True)
    assert [item["key"] for item in HFCachedIterable(streamed)] == [
        item["key"] for item in HFCachedIterable(streamed)
    ]
    assert len(list(HFCachedIterable(streamed))) == 10


def test_export_of_a_missing_cache_is_an_error_not_a_traceback(tmp_path, capsys):
    pytest.importorskip("datasets", reason="the optional datasets package is missing")
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("graphsplit: error: ManifestError") and "Traceback" not in error
