"""The Hugging Face export and import attacked (issue 26, item 3): URLs stay URLs, one safe
write path (no planted symlink followed, nothing replaced that graphsplit did not write, a full
disk is a DiskFullError with nothing left behind), and a damaged dataset is a graphsplit error,
never a raw ValueError / JSONDecodeError or a silently truncated row."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import (
    CorruptCacheError,
    DiskFullError,
    ManifestError,
    UnsupportedStorageError,
)
from graphsplit.tools.cli import main
from tests.caching.fixtures import SMALL, Pictures, loader, make_split, worker_environment

datasets = pytest.importorskip(
    "datasets", reason="the optional `datasets` package is not installed (graphsplit[datasets])"
)
from graphsplit.caching.read.hf_export import (  # noqa: E402 (after the skip)
    HFCachedDataset,
    HFCachedIterable,
    HFExportError,
    export_cache,
    to_hf_dataset,
)
from graphsplit.caching.read.hf_rows import _Rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _keys(dataset) -> list[str]:
    return [item["key"] for item in dataset]


def _same_as_folder(built, back) -> None:
    folder = CachedDataset(built)
    assert _keys(back) == folder.keys
    for mine, theirs in zip(folder, back):
        for name in mine:
            if name != "key":
                assert mine[name].dtype == theirs[name].dtype
                assert mine[name].equal(theirs[name])


def _leftovers(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir() if entry.name.startswith(".graphsplit"))


# ------------------------------------------------------------------------------ URLs stay URLs


@pytest.mark.parametrize("parquet", [False, True])
def test_export_to_s3_writes_to_the_bucket_not_a_local_folder(
    built, s3, bucket, tmp_path, monkeypatch, capsys, parquet
):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{bucket}/exports/x"
    flags = ["--parquet"] if parquet else []
    assert main(["export", str(built), "--out", url, *flags]) == 0
    assert url in capsys.readouterr().out
    assert not (tmp_path / "s3:").exists() and list(tmp_path.iterdir()) == []
    local = tmp_path / "downloaded"
    if parquet:
        s3.get_file(f"{bucket}/exports/x", str(local))
        back = datasets.load_dataset(
            "parquet", data_files=str(local), split="train", cache_dir=str(tmp_path / "hf")
        )
    else:
        s3.get(f"{bucket}/exports/x/", str(local), recursive=True)
        back = datasets.load_from_disk(str(local))
    _same_as_folder(built, HFCachedDataset(back, make_split()))
    # a second export refuses to replace it without --overwrite, and replaces it with it
    assert main(["export", str(built), "--out", url, *flags]) == 1
    assert "already holds an exported dataset" in capsys.readouterr().err
    assert main(["export", str(built), "--out", url, *flags, "--overwrite"]) == 0


def test_export_to_an_s3_prefix_holding_other_files_is_refused(built, s3, bucket, capsys):
    s3.pipe_file(f"{bucket}/mine/notes.txt", b"keep me")
    assert main(["export", str(built), "--out", f"s3://{bucket}/mine", "--overwrite"]) == 1
    error = capsys.readouterr().err
    assert "is not a saved dataset graphsplit may replace" in error and "fix:" in error
    assert s3.cat_file(f"{bucket}/mine/notes.txt") == b"keep me"
    s3.pipe_file(f"{bucket}/theirs.parquet", b"PAR1 not ours")
    with pytest.raises(HFExportError, match="not a parquet file graphsplit may replace"):
        export_cache(built, f"s3://{bucket}/theirs.parquet", parquet=True, overwrite=True)
    assert s3.cat_file(f"{bucket}/theirs.parquet") == b"PAR1 not ours"


def test_a_mangled_url_is_refused_not_made_a_local_folder(built, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(built), "--out", "s3:/bucket/x"]) == 1
    error = capsys.readouterr().err
    assert "looks like a URL whose '//' was lost" in error and "s3://bucket/x" in error
    with pytest.raises(UnsupportedStorageError):
        export_cache(built, Path("s3://bucket/x"))  # pathlib made it s3:/bucket/x
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- one safe write path


@pytest.mark.parametrize("parquet", [False, True])
def test_a_planted_partial_symlink_is_never_followed(built, tmp_path, parquet):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    out = tmp_path / "exports" / ("x.parquet" if parquet else "x")
    out.parent.mkdir()
    (out.parent / "victim").write_text("keep too")
    # where graphsplit 0.2 staged: a folder's export into outside/, a parquet file over victim
    target = out.parent / "victim" if parquet else outside
    (out.parent / f"{out.name}.partial").symlink_to(target)
    assert export_cache(built, out, parquet=parquet) == out
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    assert (out.parent / "victim").read_text() == "keep too"
    assert out.is_file() if parquet else out.is_dir() and not out.is_symlink()
    assert _leftovers(out.parent) == []
    if parquet:
        back = datasets.load_dataset(
            "parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf")
        )
    else:
        back = datasets.load_from_disk(str(out))
    _same_as_folder(built, HFCachedDataset(back))


def test_parquet_never_overwrites_a_file_it_did_not_write(built, tmp_path, capsys):
    theirs = tmp_path / "theirs.parquet"
    theirs.write_bytes(b"someone's data")
    assert main(["export", str(built), "--out", str(theirs), "--parquet", "--overwrite"]) == 1
    error = capsys.readouterr().err
    assert "not a parquet file graphsplit may replace" in error and "move" in error
    assert theirs.read_bytes() == b"someone's data"
    # a real parquet file of another tool is not ours either
    datasets.Dataset.from_dict({"key": ["a"], "x": [1.0]}).to_parquet(str(theirs))
    before = theirs.read_bytes()
    with pytest.raises(HFExportError, match="without graphsplit's export record"):
        export_cache(built, theirs, parquet=True, overwrite=True)
    assert theirs.read_bytes() == before
    # a symlink to our own export is not replaced either (nor written through)
    ours = tmp_path / "ours.parquet"
    export_cache(built, ours, parquet=True)
    link = tmp_path / "link.parquet"
    link.symlink_to(ours)
    before = ours.read_bytes()
    with pytest.raises(HFExportError, match="a symlink"):
        export_cache(built, link, parquet=True, overwrite=True)
    assert ours.read_bytes() == before and link.is_symlink()
    assert export_cache(built, ours, parquet=True, overwrite=True) == ours  # ours: replaced
    assert _leftovers(tmp_path) == []


def test_a_folder_without_the_record_is_never_replaced(built, tmp_path):
    other = tmp_path / "other"
    datasets.Dataset.from_dict({"key": ["a"], "x": [1.0]}).save_to_disk(str(other))
    names = sorted(p.name for p in other.iterdir())
    with pytest.raises(HFExportError, match="without graphsplit's export record"):
        export_cache(built, other, overwrite=True)
    assert sorted(p.name for p in other.iterdir()) == names


@pytest.mark.parametrize("parquet", [False, True])
def test_a_full_disk_is_a_disk_full_error_and_leaves_nothing(built, tmp_path, parquet):
    """No mount needed: ``ulimit -f 20`` makes the kernel refuse writes past 10 KiB (EFBIG)
    in the exporting process; the earlier export at ``out`` stays as it was."""
    big = tmp_path / "big"
    cache(make_split(), loader(Pictures(200)), big, shard_bytes=SMALL * 8, progress=False)
    out = tmp_path / "exports" / ("x.parquet" if parquet else "x")
    export_cache(built, out, parquet=parquet)  # an earlier (small) export, written freely
    before = sorted((p.name, p.read_bytes()) for p in ([out] if parquet else out.iterdir()))
    flags = "--parquet" if parquet else ""
    command = (
        f"trap '' XFSZ; ulimit -f 20; exec {sys.executable} -m graphsplit export {big} "
        f"--out {out} --overwrite {flags}"
    )
    worker = subprocess.run(
        ["bash", "-c", command],
        env=worker_environment(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert worker.returncode == 1, worker.stderr
    assert "DiskFullError: no room to write the export" in worker.stderr
    assert "File too large" in worker.stderr and "Traceback" not in worker.stderr
    assert _leftovers(out.parent) == [] and sorted(p.name for p in out.parent.iterdir()) == [
        out.name
    ]
    after = sorted((p.name, p.read_bytes()) for p in ([out] if parquet else out.iterdir()))
    assert after == before


def test_a_full_disk_in_process_is_a_disk_full_error(built, tmp_path, monkeypatch):
    def full(self, path, *args, **kwargs):
        Path(path).mkdir()
        (Path(path) / "data-00000-of-00001.arrow").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full)
    with pytest.raises(DiskFullError, match=r"(?s)no room to write the export .*run the export"):
        export_cache(built, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- damaged datasets


def _with_record(exported, change):
    """``exported`` with its export record changed by ``change(document)`` (or replaced by the
    text it returns)."""
    features = exported.features.copy()
    document = json.loads(features["key"].id)
    text = change(document)
    features["key"] = datasets.Value("string", id=text if text else json.dumps(document))
    return exported.cast(features)


def _boundary(document, name):
    return next(spec for spec in document["header"]["boundary"] if spec["name"] == name)


def _set(document, path, value):
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


DAMAGED_RECORDS = {
    "not JSON": (lambda d: '{"format": "graphsplit-hf-export", ', "not valid JSON"),
    "a JSON bomb": (lambda d: "[" * 100_000 + "]" * 100_000, "too deeply"),
    "duplicate keys": (lambda d: '{"format": 1, "format": "graphsplit-hf-export"}', "twice"),
    "a string error": (lambda d: _set(d, ["max_abs_error", "x"], "big"), "max_abs_error"),
    "a bool version": (lambda d: _set(d, ["format_version"], True), "format_version"),
    "no base64": (lambda d: _set(d, ["constants"], "***"), "constants that cannot be read"),
    "a list of constants": (lambda d: _set(d, ["constants"], [1]), "not a base64 string"),
    "garbage safetensors": (
        lambda d: _set(d, ["constants"], base64.b64encode(b"\xff" * 64).decode()),
        "constants that cannot be read",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_RECORDS))
def test_a_damaged_record_is_a_manifest_error(built, case):
    change, message = DAMAGED_RECORDS[case]
    damaged = _with_record(to_hf_dataset(built), change)
    with pytest.raises(ManifestError, match=message) as caught:
        HFCachedDataset(damaged)
    assert "fix:" in str(caught.value)


def _constants(document, tensors):
    document["constants"] = base64.b64encode(save(tensors)).decode()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: _constants(d, {"table": torch.zeros(3, 5, dtype=torch.int64)}),
            "as torch.int64",
        ),
        (lambda d: _constants(d, {"table": torch.zeros(15)}), "of rank 1"),
        (lambda d: _constants(d, {}), "lacks the constant 'table'"),
        (
            lambda d: _constants(d, {"table": torch.zeros(3, 5), "extra": torch.zeros(1)}),
            r"constants \['extra'\] that its header does not list",
        ),
        (lambda d: _set(d, ["constant_orders", "table"], [1, 1]), "not a memory order"),
        (lambda d: _set(d, ["constant_orders", "table"], [0, 1, 2]), "not a memory order"),
    ],
)
def test_a_constant_unlike_its_header_is_refused(built, change, message):
    damaged = _with_record(to_hf_dataset(built), change)
    with pytest.raises(ManifestError, match=message):
        HFCachedDataset(damaged)


def test_a_record_saying_int64_over_float_rows_is_refused_not_truncated(built):
    def int64_latents(document):
        _boundary(document, "latents")["dtype"] = "int64"

    damaged = _with_record(to_hf_dataset(built), int64_latents)
    with pytest.raises(CorruptCacheError, match=r"(?s)'latents' holds float32 values.*int64"):
        HFCachedDataset(damaged)
    # row by row (a stream without features gives Python numbers): refused too, not cast
    rows = _Rows.__new__(_Rows)
    rows.specs = {"latents": _spec("latents", 3)}
    rows.stored = {"latents": torch.int64}
    with pytest.raises(CorruptCacheError, match="holds float64 values where the export"):
        rows._array("pic000", "latents", [[[1.5, 2.0]]])
    assert rows._array("pic000", "latents", [[[1, 2]]]).dtype.name == "int64"  # ints: exact
    rows.stored = {"latents": torch.int8}
    with pytest.raises(CorruptCacheError, match="cannot hold exactly"):
        rows._array("pic000", "latents", [[[300, 2]]])


def _spec(name, rank):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, shape=(2,) * (rank + 1))


def test_damaged_rows_are_corrupt_cache_errors_naming_the_sample(built):
    exported = to_hf_dataset(built)
    columns = exported.to_dict()

    def damaged(column, value, index=0):
        copy = {name: list(values) for name, values in columns.items()}
        copy[column][index] = value
        return HFCachedDataset(datasets.Dataset.from_dict(copy, features=exported.features))

    ragged = [[[1.0, 2.0], [3.0]], *columns["latents"][0][1:]]
    with pytest.raises(CorruptCacheError, match=r"'latents' of sample 'pic000'.*rectangular"):
        damaged("latents", ragged)[0]
    with pytest.raises(CorruptCacheError, match=r"'latents' of sample 'pic000'.*missing"):
        damaged("latents", None)[0]
    with pytest.raises(CorruptCacheError, match="_graphsplit_dim_orders' of sample 'pic001'"):
        damaged("_graphsplit_dim_orders", "[[0, 1", index=1)[1]
    with pytest.raises(CorruptCacheError, match="_graphsplit_dim_orders"):
        damaged("_graphsplit_dim_orders", json.dumps([[7, 7, 7]] * 2))[0]
    with pytest.raises(CorruptCacheError, match="key' column holds None"):
        damaged("key", None)
    rows = _Rows.__new__(_Rows)
    rows.specs = {"latents": _spec("latents", 3)}
    rows.stored = {"latents": torch.float32}
    with pytest.raises(CorruptCacheError, match="has 2 dimension"):
        rows._array("pic000", "latents", [[1.0, 2.0]])


def test_a_streamed_damaged_dataset_is_refused_row_by_row(built, tmp_path):
    exported = to_hf_dataset(built)
    columns = exported.to_dict()
    columns["latents"][3] = [[[1.0, 2.0], [3.0]], *columns["latents"][3][1:]]
    datasets.Dataset.from_dict(columns, features=exported.features).to_parquet(
        str(tmp_path / "x.parquet")
    )
    streamed = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "x.parquet"), split="train", streaming=True
    )
    items = iter(HFCachedIterable(streamed))
    assert [next(items)["key"] for _ in range(3)] == ["pic000", "pic001", "pic002"]
    with pytest.raises(CorruptCacheError, match="sample 'pic003'"):
        next(items)


def test_a_cache_on_s3_exports_to_a_local_folder(built, s3, bucket, tmp_path):
    url = f"s3://{bucket}/cache"
    cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    out = export_cache(url, tmp_path / "x")
    _same_as_folder(built, HFCachedDataset(datasets.load_from_disk(str(out)), make_split()))
