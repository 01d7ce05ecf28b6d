"""Generated code's helpers, saved stage files, and caches made by graphsplit 0.1.

The helpers that stage code calls are part of every cache's identity (the fingerprint hashes
stage 1's code, which names them by module path), so their names are pinned here; a cache
written by 0.1, whose code spelled them under their old modules, must still be accepted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

import graphsplit
import graphsplit.runtime
from graphsplit.caching.format.fingerprint import fingerprint

RUNTIME_NAMES = [
    "LEGACY_NAMES",
    "check_same_read",
    "check_size",
    "check_size_read",
    "check_value",
    "decode_diagonal_gaussian",
    "decode_diagonal_gaussian_deterministic",
    "encode_diagonal_gaussian",
    "functional_inplace",
    "functional_setitem",
]
# Helpers added after 0.1: no 0.1 cache can have called them, so they have no legacy spelling.
ADDED_AFTER_0_1 = {
    "check_size",
    "check_size_read",
    "check_value",
    "functional_inplace",
    "check_same_read",
}

# fingerprint(split).code as graphsplit 0.1.0 computed it (recorded by running 0.1.0 on the
# same steps, torch 2.13): the stage code called graphsplit_trace_functional_setitem and
# graphsplit_codecs_encode_diagonal_gaussian.
CODE_DIGEST_0_1 = {
    "setitem": "sha256:331555666d194816c5964871b27fa8dfc873e1202bbbaefe417aa6327231f430",
    "sd_lora": "sha256:fc3afb5b633f02d400c79bd7f92330e945c5d32be23df6dcf2d0820fb48384a8",
}


class SetItemStep(nn.Module):
    """A frozen encoder whose output is edited with ``x[k] = v`` (a runtime helper)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.enc(x)
        h[:, 0] = 0
        return self.head(h).sum()


def _setitem_split() -> tuple[nn.Module, graphsplit.Split, torch.Tensor]:
    torch.manual_seed(0)
    model, x = SetItemStep(), torch.randn(3, 4)
    return model, graphsplit.split(model, (x,)), x


def _sd_split() -> tuple[nn.Module, graphsplit.Split, dict[str, torch.Tensor]]:
    pytest.importorskip("diffusers")
    from tests.zoo import CaptionedImages, build_sd_lora_step

    dataset = CaptionedImages(length=4, resolution=32)
    batch = default_collate([{k: v for k, v in dataset[i].items() if k != "key"} for i in (0, 1)])
    model = build_sd_lora_step(seed=0)
    return model, graphsplit.split(model, (), batch), batch


def test_runtime_names_are_pinned():
    assert sorted(graphsplit.runtime.__all__) == RUNTIME_NAMES
    for name in RUNTIME_NAMES:
        value = getattr(graphsplit.runtime, name)
        if callable(value):
            assert value.__module__ == "graphsplit.runtime", name
            if name not in ADDED_AFTER_0_1:
                assert f"graphsplit_runtime_{name}" in graphsplit.runtime.LEGACY_NAMES


def test_generated_code_calls_helpers_from_runtime():
    _, split, _ = _setitem_split()
    assert "graphsplit_runtime_functional_setitem(" in split.stage1.code


def test_fingerprint_matches_the_code_graphsplit_0_1_generated():
    _, split, _ = _setitem_split()
    assert CODE_DIGEST_0_1["setitem"] in fingerprint(split).code_aliases
    _, sd_split, _ = _sd_split()
    assert CODE_DIGEST_0_1["sd_lora"] in fingerprint(sd_split).code_aliases


def _cache_as_if_made_by(folder: Path, code: str, release: str) -> None:
    """Rewrite the manifest's fingerprint as another graphsplit release would have written it."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["fingerprint"]["code"] = code
    manifest["fingerprint"]["versions"]["graphsplit"] = release
    path.write_text(json.dumps(manifest, indent=1))


def test_a_cache_made_by_graphsplit_0_1_is_still_accepted(tmp_path):
    _, split, batch = _sd_split()
    rows = [{name: value[i] for name, value in batch.items()} for i in (0, 1)]
    graphsplit.cache(split, DataLoader(rows, batch_size=2), tmp_path, progress=False)
    _cache_as_if_made_by(tmp_path, CODE_DIGEST_0_1["sd_lora"], "0.1.0")
    with pytest.warns(UserWarning, match="other library versions"):
        data = graphsplit.CachedDataset(tmp_path, split)
    cached = graphsplit.collate([data[0], data[1]])
    torch.manual_seed(0)
    expected = split.stage2(**split.stage1(**batch))
    torch.manual_seed(0)
    assert torch.equal(split.stage2(**cached), expected)


def test_a_cache_whose_code_differs_names_the_older_release(tmp_path):
    _, split, x = _setitem_split()
    rows = [{"x": row} for row in x]
    graphsplit.cache(split, DataLoader(rows, batch_size=3), tmp_path, progress=False)
    _cache_as_if_made_by(tmp_path, "sha256:" + "0" * 64, "0.1.0")
    with pytest.raises(graphsplit.GraphsplitError) as raised:
        graphsplit.CachedDataset(tmp_path, split)
    message = str(raised.value)
    assert "made by an older graphsplit, 0.1.0 (this is " in message
    assert "overwrite=True" in message


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("make", [_setitem_split, _sd_split], ids=["setitem", "sd_lora"])
def test_saved_stage_files_run_on_their_own_and_match_the_live_stages(tmp_path, make):
    _, split, example = make()
    args, kwargs = ((example,), {}) if isinstance(example, torch.Tensor) else ((), example)
    split.save_code(tmp_path)
    stage1 = _import_file(tmp_path / "stage1.py", f"saved_stage1_{make.__name__}")
    stage2 = _import_file(tmp_path / "stage2.py", f"saved_stage2_{make.__name__}")
    saved1, saved2 = stage1.Stage1(split.stage1), stage2.Stage2(split.stage2)
    boundary = split.stage1(*args, **kwargs)
    saved_boundary = saved1(*args, **kwargs)
    assert boundary.keys() == saved_boundary.keys()
    assert all(torch.equal(boundary[k], saved_boundary[k]) for k in boundary)
    torch.manual_seed(0)
    live = split.stage2(**boundary)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = saved2(**boundary)
    assert torch.equal(live, saved)
    held = {id(p) for p in saved2.parameters()}
    assert held == {id(p) for p in split.stage2.parameters()}  # the same objects, not copies
