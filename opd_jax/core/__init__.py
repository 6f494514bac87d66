"""Pure functions of the PPO / IcePop recipe: arrays in, arrays out; jitted by their callers."""

from opd_jax.core.advantages import gae, group_advantages
from opd_jax.core.losses import policy_loss, value_loss
from opd_jax.core.mismatch import icepop_weights, tis_weights

__all__ = ["gae", "group_advantages", "icepop_weights", "policy_loss", "tis_weights", "value_loss"]
