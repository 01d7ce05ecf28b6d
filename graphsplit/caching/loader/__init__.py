"""Where the batches to cache come from, and whether they are still the cached samples.

``batches`` numbers the user's loader (dataset index or running count) and loads only what a
process computes; ``samples`` compares each sample's key and input digest with a cache's.
"""
