"""The cache format, described once: names, records, tensors and fingerprints. No I/O.

Everything here is a pure description or a pure function of bytes and tensors, so the store,
the writer and every reader agree on one definition of a cache folder.
"""
