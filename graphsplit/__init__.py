"""graphsplit: split a PyTorch training step in two, automatically and exactly.

Stage 1 computes everything that depends only on data and frozen parameters and is worth
storing; stage 2 trains from those stored tensors with the same loss and gradients.

    split = graphsplit.split(model, args=(pixels, ids))
    loss = split.stage2(**split.stage1(pixels, ids))   # == model(pixels, ids)
"""

from graphsplit.api import Split, split
from graphsplit.caching import CacheInfo, cache
from graphsplit.codecs import register_codec
from graphsplit.data import CachedDataset, CacheReport, check_cache, collate, verify_inputs
from graphsplit.errors import (
    GraphsplitError,
    MetaParameterError,
    SplitError,
    TraceError,
    VerifyError,
)
from graphsplit.plan import BoundarySpec
from graphsplit.verify import verify

__version__ = "0.1.0"

__all__ = [
    "BoundarySpec",
    "CacheInfo",
    "CacheReport",
    "CachedDataset",
    "GraphsplitError",
    "MetaParameterError",
    "Split",
    "SplitError",
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
