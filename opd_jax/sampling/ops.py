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


def nucleus_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, 1]: the smallest logit each row keeps under its top-k / top-p (see truncate_top_k_top_p)."""
    chex.assert_rank(scaled, 2)
    B, V = scaled.shape
    chex.assert_shape([top_k, top_p], (B,))
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(V)[None]
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    keep = (rank < k) & (mass_before < top_p[:, None])
    return jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)


def truncate_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k / top-p nucleus to -inf.

    scaled: [B, V] (logits / temperature); top_k: [B] int (0 = keep all); top_p: [B] in (0, 1].
    Nucleus: the highest-probability tokens whose cumulative mass *before* them is < top_p, so the
    most likely token is always kept. A token tied with the last kept one is kept too.
    """
    return jnp.where(scaled >= nucleus_threshold(scaled, top_k, top_p), scaled, _NEG)


_BLOCK = 128  # draw's two-level search: the vocabulary in blocks of this many tokens


def draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row from softmax(logits) [B, V] (-inf: never drawn), by inverting the CDF
    with one uniform u per row (instead of V Gumbel draws, jax.random.categorical: at V = 49k on a
    CPU those cost a quarter of a SmolLM2 decode step), in two levels: the vocabulary is cut into
    blocks of _BLOCK tokens; the block drawn is the first whose running mass M_j exceeds u·M,
    and inside it the token is the first whose running mass from the block's start exceeds what
    is left of u·M. So only [B, V / _BLOCK] and [B, _BLOCK] prefix sums are taken, not one
    [B, V] (a scan XLA:CPU takes about 11 ms over at 64 SmolLM2 rows; the draw, 4). A block or
    token of probability 0 is never taken; should rounding leave u·M at or past the last prefix
    sum, the last one of nonzero probability is."""
    chex.assert_rank(logits, 2)
    B, V = logits.shape
    unnormalized = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    blocks = jnp.pad(unnormalized, ((0, 0), (0, -V % _BLOCK))).reshape(B, -1, _BLOCK)
    mass = jnp.sum(blocks, axis=-1)  # [B, V / _BLOCK]
    running = jnp.cumsum(mass, axis=-1)
    target = jax.vmap(jax.random.uniform)(keys) * running[:, -1]
    block = _first(running > target[:, None], mass > 0)
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, _BLOCK]
    left = target - jnp.take_along_axis(running - mass, block[:, None], axis=1)[:, 0]
    token = _first(jnp.cumsum(inside, axis=-1) > left[:, None], inside > 0)
    return (block * _BLOCK + token).astype(jnp.int32)


def _first(past: jax.Array, positive: jax.Array) -> jax.Array:
    """Per row [B, N]: the first index where both hold; where none does, the last positive one."""
    hit = past & positive
    last = positive.shape[-1] - 1 - argmax(positive[:, ::-1])
    return jnp.where(jnp.any(hit, axis=-1), argmax(hit), last)


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum), as two plain reductions:
    XLA:CPU runs argmax's (value, index) reduce ~10x slower (14 ms at [64, 49k])."""
    top = jnp.max(x, axis=-1, keepdims=True)
    V = x.shape[-1]
    return jnp.minimum(jnp.min(jnp.where(x == top, jnp.arange(V), V), axis=-1), V - 1)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; return (token [B], logprob [B]).

    logprob = log_softmax(logits / T)[token] (SGLang's convention: before truncation); a row with
    T = 0 is greedy, argmax(logits), with logprob log_softmax(logits)[token]. keys: [B] PRNG keys.
    """
    chex.assert_rank(logits, 2)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    # the sort only when a row truncates; the cond hands back a [B, 1] threshold, not a copy of
    # the [B, V] logits
    needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0))
    threshold = jax.lax.cond(needs_truncation, nucleus_threshold,
                             lambda s, k, p: jnp.full((s.shape[0], 1), _NEG, s.dtype), scaled, top_k, top_p)
    sampled = draw(keys, jnp.where(scaled >= threshold, scaled, _NEG))
    token = jnp.where(greedy, argmax(logits), sampled).astype(jnp.int32)
    # log_softmax at the drawn token only: gathering from a [B, V] log_softmax cost a CPU decode
    # step more than the draw
    chosen = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
    return token, chosen - jax.nn.logsumexp(scaled, axis=-1)
