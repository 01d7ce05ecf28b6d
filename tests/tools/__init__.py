"""Tests of graphsplit.tools: the command line, step specs and the split picture."""
