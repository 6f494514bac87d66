"""Rewards: verifiers per domain and user reward functions by import path."""

from opd_jax.rewards.verifiers import VERIFIERS, RewardFn, exact_match, load_reward_fn, numeric_match

__all__ = ["VERIFIERS", "RewardFn", "exact_match", "load_reward_fn", "numeric_match"]
