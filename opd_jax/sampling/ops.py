"""Pure per-token sampling: temperature, top-k, top-p, and the log-prob of the drawn token."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

_NEG = -jnp.inf


def bucket(n: int, minimum: int) -> int:
    """The power of two at or above n (at least `minimum`): shapes rounded up to it keep the
    compiled variants of a jitted function few."""
    return max(minimum, 1 << (n - 1).bit_length())


def truncate_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k / top-p nucleus to -inf.

    scaled: [B, V] (logits / temperature); top_k: [B] int (0 = keep all); top_p: [B] in (0, 1].
    Nucleus: the highest-probability tokens whose cumulative mass *before* them is < top_p, so the
    most likely token is always kept. A token tied with the last kept one is kept too.
    """
    chex.assert_rank(scaled, 2)
    B, V = scaled.shape
    chex.assert_shape([top_k, top_p], (B,))
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(V)[None]
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    keep = (rank < k) & (mass_before < top_p[:, None])
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, _NEG)


def draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row from softmax(logits) [B, V] (-inf: never drawn), by inverting the CDF:
    token = #{j : F_j ≤ u·F_V} (the first j with F_j > u·F_V), F the running sum of the
    unnormalized probabilities and u ~ U[0, 1) from the row's key. A token of probability 0 adds
    nothing to F, so it is never the first to exceed u·F_V; should rounding make u·F_V reach F_V,
    the last token of nonzero probability is taken. One uniform per row instead of V Gumbel draws
    (jax.random.categorical): at V = 49k on a CPU those cost a quarter of a SmolLM2 decode step."""
    chex.assert_rank(logits, 2)
    unnormalized = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    cdf = jnp.cumsum(unnormalized, axis=-1)
    u = jax.vmap(jax.random.uniform)(keys)
    count = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    last = logits.shape[1] - 1 - jnp.argmax((unnormalized > 0)[:, ::-1], axis=-1)
    return jnp.minimum(count, last).astype(jnp.int32)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; return (token [B], logprob [B]).

    logprob = log_softmax(logits / T)[token] (SGLang's convention: before truncation); a row with
    T = 0 is greedy, argmax(logits), with logprob log_softmax(logits)[token]. keys: [B] PRNG keys.
    """
    chex.assert_rank(logits, 2)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0))
    truncated = jax.lax.cond(needs_truncation, truncate_top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)
    # an all-greedy batch (evaluation) draws nothing
    sampled = jax.lax.cond(jnp.all(greedy), lambda k, s: jnp.zeros(s.shape[:1], jnp.int32), draw, keys, truncated)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
