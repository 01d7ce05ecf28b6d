"""Tests of the runnable examples: the demo and the two-stage accelerate script."""
