"""Reading a cache: ``CachedDataset``, ``collate`` and the bucket sampler for stage 2, the audit,
the HF export."""
