"""Per-token log-probabilities and entropies of a sequence under a causal LM's logits. Pure."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, tokens: jax.Array, *, with_entropy: bool = False
                   ) -> tuple[jax.Array, jax.Array | None]:
    """Log-probability of each token given the ones before it, aligned with `tokens`:

        logp[b, t] = log_softmax(logits[b, t−1])[tokens[b, t]]  for t ≥ 1,   logp[b, 0] = 0
        entropy[b, t] = −Σ_v p_v log p_v  of that same distribution (only with with_entropy)

    logits: [B, T, V] from running the model on tokens [B, T]. Returns float32 [B, T] arrays, so
    they line up with a response mask over the same token positions.
    """
    chex.assert_rank([logits, tokens], [3, 2])
    chex.assert_equal_shape_prefix([logits, tokens], 2)
    prev = logits[:, :-1].astype(jnp.float32)
    lse = jax.nn.logsumexp(prev, axis=-1)
    picked = jnp.take_along_axis(prev, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))  # noqa: E731
    logp = pad(picked - lse)
    if not with_entropy:
        return logp, None
    probs = jnp.exp(prev - lse[..., None])
    return logp, pad(lse - jnp.sum(probs * prev, axis=-1))


def shift_right(x: jax.Array) -> jax.Array:
    """x[:, t−1] at position t and 0 at t = 0: a per-position output (the critic's value of the
    prefix up to t−1 [B, T], or the logits of the next token [B, T, V]) aligned with the token it
    comes before."""
    chex.assert_rank(x, {2, 3})
    return jnp.pad(x[:, :-1], ((0, 0), (1, 0)) + ((0, 0),) * (x.ndim - 2))
