"""Where a cache's bytes live: local files, object stores, ranged and mapped reads, locks.

Every read and write of a cache folder goes through here: atomic, fsync'd (unless
``durable=False``), regular files only inside the folder, the same operations on fsspec stores.
"""
