"""Facts about every traced node, and the codecs that let non-tensors cross the boundary.

``node_facts`` runs the graph on ``meta`` at two batch sizes: batch layout, bytes, FLOPs,
random draws, samples mixed. ``boundary_codecs`` inserts the encode / decode pair that caches a
non-tensor value (a VAE's latent distribution) as tensors.
"""
