"""Reading a cache: ``CachedDataset`` and ``collate`` for stage 2, the audit, the HF export."""
