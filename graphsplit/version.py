"""graphsplit's release, in a module of its own so that any module can read it without a cycle.

Caches record it (their fingerprint's ``versions``), and a cache made by an older release is
named as such when its code digest differs.
"""

__version__ = "0.2.0"
