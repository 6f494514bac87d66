"""A user's own algorithm parts, named by import path from configs and tests (nothing in opd_jax
knows them)."""

import jax.numpy as jnp

from opd_jax.core import part


def scaled_grpo(inputs, config, *, scale=1.0):
    """Group-mean baseline times `scale` on every response token (no critic)."""
    grouped = inputs.rewards.reshape(-1, inputs.group_size)
    centered = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
    return jnp.where(inputs.mask > 0, scale * centered[:, None], 0.0)


@part(needs=("critic",))
def one_step_td(inputs, config):
    """A TD(0) advantage from the critic: r_t + V_{t+1} − V_t on the response tokens."""
    next_values = jnp.concatenate([inputs.values[:, 1:], jnp.zeros_like(inputs.values[:, :1])], axis=1)
    return jnp.where(inputs.mask > 0, inputs.token_rewards + next_values * inputs.mask - inputs.values, 0.0)


def reinforce_loss(logp, logp_old, advantages, mask, eps_low, eps_high):
    """Plain REINFORCE on the response tokens (ratio reported, not clipped)."""
    return -advantages * logp, jnp.exp(logp - logp_old)


def per_sample_grpo(inputs, config):
    """A mistake: one advantage per sample [B], not per token [B, T]."""
    grouped = inputs.rewards.reshape(-1, inputs.group_size)
    return (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
