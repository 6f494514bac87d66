"""Pure functions of the recipe: arrays in, arrays out; jitted and sharded by their callers.

    advantages    gae, group_advantages (GRPO), rloo_advantages, reinforce_pp_advantages, length_adaptive_lambda,
                  outcome_rewards, whiten
    registry      ADVANTAGE_ESTIMATORS, POLICY_LOSSES, MISMATCH_CORRECTIONS: every algorithm part by name
    algorithms    algorithm parts in files of their own (off-policy sequence masking, ...)
    mismatch      mismatch_weights (IcePop, TIS, MIS, sequence variants, veto), mismatch_metrics
    losses        policy_loss (PPO, GSPO, CISPO surrogates), value_loss, kl_estimate, aggregate
    forward       sequence_logits / sequence_logprobs / sequence_values / policy_logprobs
    update        the epochs × mini-batches × micro-batches driver every step shares
    steps         ppo_step (+ score_batch), opd_step (+ score_student, teacher_scores), sft_step
"""

from opd_jax.core.advantages import (
    gae,
    group_advantages,
    length_adaptive_lambda,
    outcome_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from opd_jax.core.batch import BatchError, RolloutBatch, validate_batch
from opd_jax.core.distributions import shift_right, token_logprobs
from opd_jax.core.forward import policy_logprobs, sequence_logits, sequence_logprobs, sequence_values
from opd_jax.core.losses import SurrogateConfig, aggregate, kl_estimate, loss_denominator, policy_loss, value_loss
from opd_jax.core.mismatch import (
    MismatchCorrection,
    icepop_weights,
    mismatch_metrics,
    mismatch_weights,
    tis_weights,
)
from opd_jax.core.opd import (
    DIVERGENCES,
    balance_weights,
    divergence,
    full_support,
    opd_advantages,
    reverse_kl_advantage,
    running_divergence,
    select_teacher,
    top_k_support,
)
from opd_jax.core.opd_step import DISTILL_LOSSES, PER_TEACHER_KL, DistillBatch, OPDConfig, opd_step, score_student, teacher_scores
from opd_jax.core.optim import OptimizerConfig, make_optimizer
from opd_jax.core.ppo import KLConfig, PPOConfig, PPOState, advantages_and_returns, ppo_step, score_batch
from opd_jax.core.registry import ADVANTAGE_ESTIMATORS, MISMATCH_CORRECTIONS, POLICY_LOSSES, AdvantageInputs, part
from opd_jax.core.sft import sft_step
from opd_jax.core.state import PolicyState
from opd_jax.core.update import UpdateConfig

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageInputs", "BatchError", "DISTILL_LOSSES", "DIVERGENCES", "DistillBatch",
           "KLConfig", "MISMATCH_CORRECTIONS", "MismatchCorrection", "OPDConfig", "OptimizerConfig",
           "PER_TEACHER_KL", "POLICY_LOSSES", "PPOConfig", "PPOState", "PolicyState", "RolloutBatch",
           "SurrogateConfig", "UpdateConfig", "advantages_and_returns", "aggregate", "balance_weights", "divergence",
           "full_support", "gae", "group_advantages", "icepop_weights", "kl_estimate", "length_adaptive_lambda",
           "loss_denominator", "make_optimizer", "mismatch_metrics", "mismatch_weights", "opd_advantages",
           "opd_step", "outcome_rewards", "part", "policy_logprobs", "policy_loss", "ppo_step",
           "reinforce_pp_advantages", "reverse_kl_advantage", "rloo_advantages", "running_divergence", "score_batch",
           "score_student", "select_teacher", "sequence_logits", "sequence_logprobs", "sequence_values", "sft_step",
           "shift_right", "teacher_scores", "tis_weights", "token_logprobs", "top_k_support", "validate_batch",
           "value_loss", "whiten"]
