"""DAPO's dynamic sampling (Yu et al. 2025, §3.2): a group whose samples all got the same reward
has zero group-baseline advantage on every sample, so it carries no gradient and only shrinks
the batch. The shell drops such groups and keeps drawing until the step's batch is full
(`rollout.dynamic_sampling`; bounded, counted in the metrics), so a step's batch size holds.

    keep group g  ⇔  max_i R_{g,i} − min_i R_{g,i} > tol
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def informative_groups(rewards: jax.Array, group_size: int, tol: float = 1e-6) -> jax.Array:
    """[B / group_size] booleans: whether each group of consecutive samples has rewards that
    differ (by more than tol). rewards: [B], B a multiple of group_size."""
    chex.assert_rank(rewards, 1)
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    grouped = rewards.astype(jnp.float32).reshape(-1, group_size)
    spread = jnp.nanmax(grouped, axis=1) - jnp.nanmin(grouped, axis=1)  # a failed sample (NaN) has no say
    return spread > tol
