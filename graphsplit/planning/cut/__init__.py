"""Choosing the boundary: taint, the prices of storing or recomputing, and the min-cut.

``boundary`` narrates the choice and is the only place it is made; ``recompute`` prices frozen
work stage 2 may redo; ``min_cut`` is the networkx cut itself.
"""
