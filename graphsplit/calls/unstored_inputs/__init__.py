"""Step inputs the module-level cache need not store: only cached calls compute with them.

A diffusion step's ``pixel_values`` reach nothing but the VAE (``vae.encode(pixel_values.to(
weight_dtype))``), whose call the cache answers: stage 2 never needs their values, only what
they cost to store (a 512 x 512 RGB image is 3 MiB in float32, its latents 16 KiB).

:mod:`.derivation` follows, during the probes, every tensor the step computes from a batched
tensor input outside the frozen calls; :mod:`.stand_in` is what stage 2 passes in the input's
place, a tensor on ``meta`` of the batch's shape whose every operation either gives another
stand-in or raises, and whose ``.device`` is the device of stage 2's batch (DETR places its
pixel mask by ``pixel_values.device``); :mod:`.ops` is the one table of what a stand-in allows
and of the device it carries, shared by both, so an input is left out of the cache only where
stage 2 can run the step's code on its stand-in.
"""
