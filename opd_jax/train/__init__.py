"""The imperative shell: the training loop, its checkpoints, metrics and evaluation."""

from opd_jax.train.errors import RunError
from opd_jax.train.loop import train

__all__ = ["RunError", "train"]
