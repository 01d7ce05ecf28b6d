"""graphsplit: split a PyTorch training step in two, automatically and exactly.

Stage 1 computes everything that depends only on data and frozen parameters and is worth
storing; stage 2 trains from those stored tensors with the same loss and gradients.

    split = graphsplit.split(model, args=(pixels, ids))
    loss = split.stage2(**split.stage1(pixels, ids))   # == model(pixels, ids)

``model`` may also be a plain function (a training loop's body over local or global models) or
a bound method: ``graphsplit.split(training_step, (batch,))``.
"""

from graphsplit.api import Split, split
from graphsplit.artifacts import BoundarySpec
from graphsplit.caching import (
    BucketBatchSampler,
    CachedDataset,
    CacheInfo,
    CacheReport,
    LiveCache,
    cache,
    check_cache,
    collate,
    verify_inputs,
)
from graphsplit.calls import CallSplit
from graphsplit.errors import (
    GraphsplitError,
    MetaParameterError,
    SplitError,
    TraceError,
    VerifyError,
)
from graphsplit.planning.analyse.boundary_codecs import register_codec
from graphsplit.tools.spec import StepSpec
from graphsplit.verify import verify
from graphsplit.version import __version__

__all__ = [
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
