"""The imperative shell: the training loop, its checkpoints, metrics and evaluation."""

from opd_jax.train.loop import train
from opd_jax.train.rollouts import RunError

__all__ = ["RunError", "train"]
