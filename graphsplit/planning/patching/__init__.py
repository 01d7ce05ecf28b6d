"""What the trace changes in the process while it runs, and how it is undone.

Tracing runs the user's Python with torch.fx proxies; library code asks those proxies
``isinstance``, ``len`` and the like, creates tensors with factories and writes state into its
modules. The modules here make those answers match eager and put everything back afterwards.
``originals`` holds Python's own builtins, bound before anything is patched.
"""
