"""The rules every step of the planning shares: one concept a module, no pipeline step here.

A rule is a fact about a traced node that several steps read or write (the tracer records it,
the cut obeys it, codegen emits its check): which user line made a node, which sizes the plan
holds, what taints a node, whether it mixes samples, which grad mode or checkpoint region it ran
in, what an opaque call is. Each rule lives in one module so that following it never means
visiting every step; the steps above import it, it imports none of them.
"""
