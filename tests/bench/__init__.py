"""Smoke tests of the benchmark scripts: the structure of their output, not their numbers."""
