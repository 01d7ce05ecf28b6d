"""Reading a cache: ``CachedDataset`` and ``collate`` for stage 2, ``check_cache``, the HF export.
"""
