"""Integrations with the trainers people use: they import the core; the core never imports them.

- :mod:`graphsplit.integrations.transformers`: a ``transformers.Trainer`` subclass keeps its
  ``compute_loss``; :func:`~graphsplit.integrations.transformers.split_trainer` splits that
  loss, caches stage 1 over the train dataset and trains stage 2 inside the trainer's loop.
- :mod:`graphsplit.integrations.trl`: TRL DPO's reference log-probs from a graphsplit cache.
"""
