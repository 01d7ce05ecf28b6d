"""One plan per shape signature: what a plan's checks expect, and the dispatch between plans.

:mod:`~graphsplit.signatures.signature` reads a plan's signature off its stage code and records
the example it was made from; :mod:`~graphsplit.signatures.dispatch` holds a split's plans and
makes ``split.stage1`` / ``split.stage2`` dispatch between them, making a plan when a batch
first needs one.
"""
