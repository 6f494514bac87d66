"""Pure functions of the PPO / IcePop recipe: arrays in, arrays out; jitted by their callers."""

from opd_jax.core.advantages import gae, group_advantages, length_adaptive_lambda, outcome_rewards, whiten
from opd_jax.core.batch import BatchError, RolloutBatch, validate_batch
from opd_jax.core.distributions import shift_right, token_logprobs
from opd_jax.core.losses import aggregate, kl_estimate, loss_denominator, policy_loss, value_loss
from opd_jax.core.mismatch import (
                                   CORRECTION_KINDS,
                                   MismatchCorrection,
                                   icepop_weights,
                                   mismatch_metrics,
                                   mismatch_weights,
                                   tis_weights,
)
from opd_jax.core.opd import (
                                   full_reverse_kl,
                                   opd_advantages,
                                   reverse_kl_advantage,
                                   select_teacher,
                                   top_k_reverse_kl,
)
from opd_jax.core.optim import OptimizerConfig, make_optimizer
from opd_jax.core.ppo import (
                                   KLConfig,
                                   PPOConfig,
                                   PPOState,
                                   policy_logprobs,
                                   ppo_step,
                                   score_batch,
                                   sequence_logprobs,
                                   sequence_values,
)

__all__ = ["CORRECTION_KINDS", "BatchError", "KLConfig", "MismatchCorrection", "OptimizerConfig", "PPOConfig",
           "PPOState", "RolloutBatch", "aggregate", "full_reverse_kl", "gae", "group_advantages", "icepop_weights",
           "kl_estimate", "length_adaptive_lambda", "loss_denominator", "make_optimizer", "mismatch_metrics",
           "mismatch_weights", "opd_advantages", "outcome_rewards", "policy_logprobs", "policy_loss", "ppo_step",
           "reverse_kl_advantage", "score_batch", "select_teacher", "sequence_logprobs", "sequence_values", "shift_right",
           "tis_weights", "token_logprobs", "top_k_reverse_kl", "validate_batch", "value_loss", "whiten"]
