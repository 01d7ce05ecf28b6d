"""The public surface is a contract: its names, signatures and docstrings are pinned here.

Changing one of these is an API change: update the docs and this test together.
"""

from __future__ import annotations

import inspect

import pytest

import graphsplit

PUBLIC_NAMES = [
    "BoundarySpec",
    "BucketBatchSampler",
    "CacheInfo",
    "CacheReport",
    "CachedDataset",
    "CallSplit",
    "GraphsplitError",
    "LiveCache",
    "MetaParameterError",
    "Split",
    "SplitError",
    "StepSpec",
    "TraceError",
    "VerifyError",
    "__version__",
    "cache",
    "check_cache",
    "collate",
    "register_codec",
    "split",
    "verify",
    "verify_inputs",
]

SIGNATURES = {
    "split": (
        "(model: 'nn.Module | Callable[..., Any]', args: 'tuple[Any, ...]' = (), "
        "kwargs: 'dict[str, Any] | None' = None, *, frozen: 'FrozenSpec' = None, "
        "recompute: 'Recompute' = 'never', max_plans: 'int' = 8, path: 'SplitPath' = 'auto') "
        "-> 'Split | CallSplit'"
    ),
    "verify": (
        "(model: 'nn.Module | Callable[..., Any]', split: 'Split | CallSplit', "
        "args: 'tuple[Any, ...]' = (), "
        "kwargs: 'dict[str, Any] | None' = None, *, seed: 'int' = 0, rtol: 'float' = 0.0, "
        "atol: 'float' = 0.0) -> 'list[Comparison]'"
    ),
    "register_codec": (
        "(kind: 'type | str', encode: 'Callable[[Any], torch.Tensor]', "
        "decode: 'Callable[[torch.Tensor], Any]', *, suffix: 'str' = 'encoded') -> 'None'"
    ),
}

SIGNATURES["cache"] = (
    "(split: 'Split', dataloader: 'Any', path: 'str | os.PathLike[str]', *, "
    "accelerator: 'Any' = None, shard_bytes: 'int' = 268435456, "
    "storage_dtype: 'torch.dtype | None' = None, overwrite: 'bool' = False, "
    "progress: 'bool | None' = None, durable: 'bool' = True) -> 'CacheInfo'"
)

SIGNATURES["LiveCache"] = (
    "(split: 'Split', path: 'str | os.PathLike[str]', *, accelerator: 'Any' = None, "
    "shard_bytes: 'int' = 268435456, storage_dtype: 'torch.dtype | None' = None, "
    "overwrite: 'bool' = False, durable: 'bool' = True) -> 'None'"
)

LIVE_CACHE_METHODS = {
    "step": "(self, batch: 'Mapping[str, Any]') -> 'Any'",
    "finish": "(self) -> 'CacheInfo'",
    "close": "(self) -> 'None'",
    "dataset": "(self, **options: 'Any') -> 'CachedDataset'",
}


@pytest.mark.parametrize("name", sorted(LIVE_CACHE_METHODS))
def test_live_cache_methods_are_pinned(name):
    assert str(inspect.signature(getattr(graphsplit.LiveCache, name))) == LIVE_CACHE_METHODS[name]


SIGNATURES["BucketBatchSampler"] = (
    "(source: 'HasBuckets | Mapping[Hashable, Sequence[int]]', batch_size: 'int', *, "
    "shuffle: 'bool' = True, seed: 'int' = 0, drop_last: 'bool' = False, "
    "num_replicas: 'int | None' = None, rank: 'int | None' = None) -> 'None'"
)

SPLIT_METHODS = {
    "report": "(self) -> 'str'",
    "save_code": "(self, folder: 'str | os.PathLike[str]') -> 'Path'",
    "to_json": "(self) -> 'dict[str, Any]'",
}

BOUNDARY_SPEC_FIELDS = [
    "name",
    "shape",
    "dtype",
    "batch_dim",
    "bytes_per_sample",
    "source",
    "pad_dim",
]


def test_all_is_pinned():
    assert sorted(graphsplit.__all__) == PUBLIC_NAMES
    for name in graphsplit.__all__:
        assert hasattr(graphsplit, name), name


def test_version_is_a_string():
    assert isinstance(graphsplit.__version__, str) and graphsplit.__version__.count(".") == 2


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_function_signatures_are_pinned(name):
    assert str(inspect.signature(getattr(graphsplit, name))) == SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(SPLIT_METHODS))
def test_split_methods_are_pinned(name):
    assert str(inspect.signature(getattr(graphsplit.Split, name))) == SPLIT_METHODS[name]


CACHED_DATASET_METHODS = {
    "loader": (
        "(self, batch_size: 'int', *, shuffle: 'bool' = True, seed: 'int' = 0, "
        "drop_last: 'bool' = False, num_replicas: 'int | None' = None, "
        "rank: 'int | None' = None, **loader_options: 'Any') -> 'BucketLoader'"
    ),
    "buckets": "(self) -> 'dict[tuple[tuple[int | None, ...], ...], list[int]]'",
}

BUCKET_SAMPLER_METHODS = {
    "set_epoch": "(self, epoch: 'int') -> 'None'",
    "state_dict": "(self) -> 'dict[str, Any]'",
    "load_state_dict": "(self, state: 'Mapping[str, Any]') -> 'None'",
    "epoch_batches": "(self, epoch: 'int') -> 'list[list[int]]'",
}


@pytest.mark.parametrize("name", sorted(CACHED_DATASET_METHODS))
def test_cached_dataset_methods_are_pinned(name):
    signature = inspect.signature(getattr(graphsplit.CachedDataset, name))
    assert str(signature) == CACHED_DATASET_METHODS[name]


@pytest.mark.parametrize("name", sorted(BUCKET_SAMPLER_METHODS))
def test_bucket_sampler_methods_are_pinned(name):
    signature = inspect.signature(getattr(graphsplit.BucketBatchSampler, name))
    assert str(signature) == BUCKET_SAMPLER_METHODS[name]


def test_split_attributes_are_pinned():
    fields = list(inspect.signature(graphsplit.Split).parameters)
    assert fields[:5] == ["stage1", "stage2", "boundary", "input_names", "trainable"]


def test_a_module_level_split_has_the_methods_of_a_split():
    """The rest of graphsplit (cache, CachedDataset, verify) reads these of either path's split."""
    fields = list(inspect.signature(graphsplit.CallSplit).parameters)
    assert fields[:5] == ["stage1", "stage2", "boundary", "input_names", "trainable"]
    for name in SPLIT_METHODS:
        assert inspect.getdoc(getattr(graphsplit.CallSplit, name)), name


def test_boundary_spec_fields_are_pinned():
    assert list(inspect.signature(graphsplit.BoundarySpec).parameters) == BOUNDARY_SPEC_FIELDS


def test_errors_share_one_base_class():
    for name in ("MetaParameterError", "SplitError", "TraceError", "VerifyError"):
        assert issubclass(getattr(graphsplit, name), graphsplit.GraphsplitError)
    assert issubclass(graphsplit.VerifyError, AssertionError)


@pytest.mark.parametrize("name", [name for name in PUBLIC_NAMES if name != "__version__"])
def test_every_public_name_has_its_own_docstring(name):
    value = getattr(graphsplit, name)
    doc = value.__doc__
    assert doc and doc.strip(), f"graphsplit.{name} has no docstring"
    if inspect.isclass(value):
        inherited = [base.__doc__ for base in value.__mro__[1:]]
        assert doc not in inherited, f"graphsplit.{name} only inherits its docstring"


@pytest.mark.parametrize("name", ["split", "verify", "register_codec"])
def test_public_functions_document_an_example(name):
    assert "Example:" in getattr(graphsplit, name).__doc__


@pytest.mark.parametrize("name", sorted(SPLIT_METHODS))
def test_split_methods_have_docstrings(name):
    assert inspect.getdoc(getattr(graphsplit.Split, name))


def test_module_docstring():
    assert graphsplit.__doc__ and "graphsplit" in graphsplit.__doc__
