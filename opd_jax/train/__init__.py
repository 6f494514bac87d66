"""The imperative shell: the training loop, its checkpoints, metrics and evaluation."""

from opd_jax.train.loop import RunError, train

__all__ = ["RunError", "train"]
