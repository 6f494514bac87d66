"""Rewards: verifiers per domain and user reward functions by import path."""

from opd_jax.rewards.compute import RewardError, compute_rewards
from opd_jax.rewards.verifiers import VERIFIERS, RewardFn, exact_match, load_reward_fn, numeric_match

__all__ = ["VERIFIERS", "RewardError", "RewardFn", "compute_rewards", "exact_match", "load_reward_fn",
           "numeric_match"]
