"""``graphsplit.cache()``: run stage 1 over a loader into a cache folder, crash-safe.

``cache_run`` narrates the run; ``folder_decision`` decides nothing / resume / start afresh;
``shards`` computes and saves the shards; ``processes`` makes accelerate's processes agree.
"""
