"""Advantage estimators: token-level GAE from a critic, and the critic-free group baselines
(GRPO, RLOO, REINFORCE++-baseline), each registered in `ADVANTAGE_ESTIMATORS`. Pure."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from opd_jax.core.registry import ADVANTAGE_ESTIMATORS, AdvantageInputs


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0,
        lam: float | jax.Array = 0.95, final_values: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Generalized Advantage Estimation (Schulman et al. 2016), token level, over masked tokens.

        δ_t = r_t + γ·V_next(t) − V_t,    A_t = δ_t + γλ·A_next(t),    returns_t = A_t + V_t

    where next(t) is the next token with mask 1 (masked tokens are skipped: the observation
    tokens of a multi-turn episode are holes, and V_next of a turn's last token is the value at
    the next turn's first) and, after the last one, V = final_values (the critic's value of where
    a truncated episode stopped: bootstrapping; default 0, an episode that ended) and A = 0.
    rewards, values, mask: [B, T]; lam: a scalar or one λ per row [B] (see
    `length_adaptive_lambda`); final_values: [B]. Outputs are zero where mask is 0. One reverse
    `lax.scan` over T (2–4× faster than an associative scan on CPU, see BENCHMARKS.md).
    """
    chex.assert_rank([rewards, values, mask], 2)
    chex.assert_equal_shape([rewards, values, mask],
                            custom_message="gae: rewards, values and mask must share one [B, T] shape")
    m = mask.astype(jnp.float32)
    r, v = rewards.astype(jnp.float32), values.astype(jnp.float32)
    lam = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), rewards.shape[:1])

    def step(carry, x):
        next_value, next_adv = carry
        r_t, v_t, m_t = x
        adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        carry = (jnp.where(m_t > 0, v_t, next_value), jnp.where(m_t > 0, adv, next_adv))
        return carry, jnp.where(m_t > 0, adv, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    final = zeros if final_values is None else jnp.broadcast_to(final_values.astype(jnp.float32), zeros.shape)
    _, adv = jax.lax.scan(step, (final, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv.T
    return adv, jnp.where(m > 0, adv + v, 0.0)


def group_advantages(rewards: jax.Array, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
    """GRPO baseline over consecutive groups of `group_size` samples of the same prompt.

        A_i = (R_i − mean_group(R)) / (std_group(R) + eps)    (std division off: Dr.GRPO)

    rewards: [B] with B a multiple of group_size; std is the population std. Returns [B].
    """
    chex.assert_rank(rewards, 1)
    if rewards.shape[0] % group_size:
        raise ValueError(f"batch of {rewards.shape[0]} rewards is not a multiple of group_size={group_size}")
    grouped = rewards.astype(jnp.float32).reshape(-1, group_size)
    centered = grouped - grouped.mean(axis=1, keepdims=True)
    if normalize_std:
        centered = centered / (grouped.std(axis=1, keepdims=True) + eps)
    return centered.reshape(-1)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each sample's baseline is the mean reward
    of the other samples of its prompt,

        A_i = R_i − (1/(G−1)) Σ_{j≠i} R_j  =  G/(G−1) · (R_i − mean_group(R))

    over consecutive groups of G = group_size ≥ 2 samples. rewards: [B]. Returns [B]."""
    chex.assert_rank(rewards, 1)
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt, got group_size={group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"batch of {rewards.shape[0]} rewards is not a multiple of group_size={group_size}")
    grouped = rewards.astype(jnp.float32).reshape(-1, group_size)
    others = (grouped.sum(axis=1, keepdims=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def reinforce_pp_advantages(rewards: jax.Array, mask: jax.Array, group_size: int, eps: float = 1e-8) -> jax.Array:
    """REINFORCE++-baseline (Hu et al. 2025): the group mean as baseline, then normalised over the
    whole batch rather than per group,

        A'_i = R_i − mean_group(R),    A_t = (A'_i − μ) / (σ + eps)  on every response token t of i

    with μ, σ the mean and (population) std of A' over the batch's response tokens (a long
    response weighs as many tokens as it has). rewards: [B]; mask: [B, T]. Returns [B, T], zero
    off the mask."""
    chex.assert_rank([rewards, mask], [1, 2])
    centered = group_advantages(rewards, group_size, normalize_std=False)
    m = mask.astype(jnp.float32)
    return whiten(jnp.where(m > 0, centered[:, None], 0.0), m, eps)


def length_adaptive_lambda(mask: jax.Array, alpha: float = 0.05) -> jax.Array:
    """VAPO's length-adaptive GAE λ for the policy, per row: λ = 1 − 1/(α·len), len = the number
    of response tokens, clipped to [0, 1] (short responses get λ = 0, long ones λ → 1). [B]."""
    chex.assert_rank(mask, 2)
    length = jnp.sum(mask.astype(jnp.float32), axis=1)
    return jnp.clip(1.0 - 1.0 / (alpha * jnp.maximum(length, 1.0)), 0.0, 1.0)


def outcome_rewards(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """Token rewards [B, T] from one scalar outcome reward per sample [B]: the reward sits on the
    last token whose mask is 1, every other token gets 0 (rows with no such token get nothing)."""
    chex.assert_rank([rewards, mask], [1, 2])
    chex.assert_equal_shape_prefix([rewards, mask], 1)
    m = mask.astype(jnp.float32)
    T = mask.shape[1]
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=1)
    is_last = (jnp.arange(T)[None, :] == last[:, None]) & (m > 0)
    return jnp.where(is_last, rewards.astype(jnp.float32)[:, None], 0.0)


def whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(x − mean) / (std + eps) over the masked entries of the whole batch; 0 where mask is 0."""
    chex.assert_equal_shape([x, mask],
                            custom_message="whiten: x and mask must share one shape")
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    on = m > 0
    mean = jnp.sum(jnp.where(on, x, 0.0)) / n
    var = jnp.sum(jnp.where(on, jnp.square(x - mean), 0.0)) / n
    return jnp.where(on, (x - mean) / (jnp.sqrt(var) + eps), 0.0)


# --- the registered estimators (`algorithm.ppo.advantage`): fn(inputs, config, **params) -> [B, T]

@ADVANTAGE_ESTIMATORS.register("gae", needs=("critic",))
def gae_estimator(inputs: AdvantageInputs, config: Any) -> jax.Array:
    """Per-token GAE from the critic (GLM-5.2), λ = lam_policy or VAPO's length-adaptive λ."""
    lam = length_adaptive_lambda(inputs.mask, config.adaptive_alpha) if config.lam_policy == "adaptive" \
        else config.lam_policy
    return gae(inputs.token_rewards, inputs.values, inputs.mask, config.gamma, lam, inputs.final_values)[0]


def _on_tokens(per_sample: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(mask > 0, per_sample[:, None], 0.0)


@ADVANTAGE_ESTIMATORS.register("grpo", needs=("group",))
def grpo_estimator(inputs: AdvantageInputs, config: Any) -> jax.Array:
    """GRPO's group baseline (Dr.GRPO with grpo_normalize_std false), on every response token."""
    return _on_tokens(group_advantages(inputs.rewards, inputs.group_size, config.grpo_normalize_std), inputs.mask)


@ADVANTAGE_ESTIMATORS.register("rloo", needs=("group", "pairs"))
def rloo_estimator(inputs: AdvantageInputs, config: Any) -> jax.Array:
    """RLOO's leave-one-out baseline, on every response token."""
    return _on_tokens(rloo_advantages(inputs.rewards, inputs.group_size), inputs.mask)


@ADVANTAGE_ESTIMATORS.register("reinforce++", needs=("group",))
def reinforce_pp_estimator(inputs: AdvantageInputs, config: Any) -> jax.Array:
    """REINFORCE++-baseline: the group mean as baseline, normalised over the batch's tokens."""
    return reinforce_pp_advantages(inputs.rewards, inputs.mask, inputs.group_size)
