"""Stage 1 and stage 2 as ``torch.fx.GraphModule``s, from any side-per-node assignment.

``stages`` copies each stage's nodes out of the traced graph; ``stage_passes`` adds what the
trace implied beyond its nodes (size checks, checkpointing, frozen value checks).
"""
