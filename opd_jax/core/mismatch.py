"""Train/inference mismatch corrections: per-token weights from trainer vs engine log-probs. Pure."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def icepop_weights(logp_old: jax.Array, logp_infer: jax.Array, beta: float = 2.0,
                   alpha: float | None = None) -> jax.Array:
    """IcePop (Ring-1T; GLM-5): k = exp(logp_old − logp_infer); weight = k if α ≤ k ≤ β else 0.

    α defaults to 1/β (GLM-5: β = 2). Tokens outside the band are masked, not clipped. The weight
    is a constant of the loss (stop-gradient). logp_old, logp_infer: [B, T] -> [B, T].
    """
    chex.assert_equal_shape([logp_old, logp_infer])
    alpha = 1.0 / beta if alpha is None else alpha
    k = jnp.exp(logp_old.astype(jnp.float32) - logp_infer.astype(jnp.float32))
    return jax.lax.stop_gradient(jnp.where((k >= alpha) & (k <= beta), k, 0.0))


def tis_weights(logp_old: jax.Array, logp_infer: jax.Array, hi: float = 2.0, lo: float = 0.0) -> jax.Array:
    """Truncated importance sampling: weight = clip(exp(logp_old − logp_infer), lo, hi), stop-gradient."""
    chex.assert_equal_shape([logp_old, logp_infer])
    k = jnp.exp(logp_old.astype(jnp.float32) - logp_infer.astype(jnp.float32))
    return jax.lax.stop_gradient(jnp.clip(k, lo, hi))
