"""Running nodes on fake values: shapes, dtypes, FLOPs and ATen ops without real weights.

The model is viewed on the ``meta`` device (``analysis_view``); torch.fx Interpreters run a
traced graph node by node there, record the ATen ops each node ran and count its FLOPs; memos
answer repeated ops and repeated pure module calls without running them again.
"""
