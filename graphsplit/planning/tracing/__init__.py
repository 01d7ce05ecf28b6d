"""The training step as a torch.fx graph at the level of the user's code.

``tracer`` records the step with fake values on every node and guards on the Python values it
read; ``inplace`` turns in-place writes into dataflow; ``rewrites`` restores input names and
devices.
"""
