"""Per-token log-probabilities and entropies of a sequence under a causal LM's logits. Pure."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

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


def chunked_token_logprobs(hidden: jax.Array, head: Callable[[jax.Array], jax.Array], tokens: jax.Array, *,
                           chunk: int, with_entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """token_logprobs(head(hidden), tokens), with the head's logits [B, chunk, V] of `chunk`
    positions at a time the only ones that exist, forward and backward (`chunked_positions`).
    hidden [B, T, H] the final hidden states; head maps [B, c, H] to float32 logits [B, c, V]. The
    same numbers as the unchunked form; without the [B, T, V] tensor, whose size at T = 32k and a
    152k vocabulary is 18.6 GiB per row in float32."""
    logp, entropy = chunked_positions(hidden, head, tokens, functools.partial(picked_and_entropy, with_entropy=with_entropy),
                                      chunk=chunk)
    return logp, entropy if with_entropy else None


def picked_and_entropy(logits: jax.Array, targets: jax.Array, with_entropy: bool = True
                       ) -> tuple[jax.Array, jax.Array]:
    """(log softmax(logits)[targets], the entropy of softmax(logits), or zeros without
    with_entropy): logits [..., V], targets [...] → [...] each, float32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse
    if not with_entropy:
        return picked, jnp.zeros_like(picked)
    return picked, lse - jnp.sum(jnp.exp(logits - lse[..., None]) * logits, axis=-1)


def chunked_positions(hidden: jax.Array, head: Callable[[jax.Array], jax.Array], tokens: jax.Array,
                      per_position: Callable[..., tuple[jax.Array, ...]], inputs: Sequence[jax.Array] = (), *,
                      chunk: int) -> tuple[jax.Array, ...]:
    """per_position(logits, targets, *inputs) at every position t ≥ 1 of tokens [B, T], where

        logits = head(hidden[:, t−1])  (the distribution of token t; float32 [B, c, V])
        targets = tokens[:, t],  inputs[i][:, t]  (each [B, T, ...])

    evaluated `chunk` positions at a time: the head's logits of one chunk are the only ones that
    exist, forward and backward (each chunk is rematerialised: its logits are computed again for
    the gradient, never stored). per_position returns a tuple of [B, c, ...] arrays; they come
    back as [B, T, ...], zero at t = 0."""
    chex.assert_rank([hidden, tokens], [3, 2])
    chex.assert_equal_shape_prefix([hidden, tokens, *inputs], 2)
    B, T, _ = hidden.shape
    targets = tokens[:, 1:].astype(jnp.int32)
    later = [x[:, 1:] for x in inputs]
    front = lambda x: jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    if chunk >= T - 1:
        return tuple(front(x) for x in per_position(head(hidden[:, :-1]).astype(jnp.float32), targets, *later))
    n = -(-(T - 1) // chunk)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n * chunk - (T - 1))] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    # chunk j holds positions j, j + n, j + 2n, ...: strided, so a sequence split over devices
    # (context parallelism: contiguous shards) gives every device its share of every chunk
    split = lambda x: jnp.moveaxis(pad(x).reshape(B, chunk, n, *x.shape[2:]), 2, 0)  # noqa: E731

    @jax.checkpoint
    def one(h: jax.Array, t: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(per_position(head(h).astype(jnp.float32), t, *xs))

    outs = jax.lax.map(lambda args: one(*args), (split(hidden[:, :-1]), split(targets), *map(split, later)))
    join = lambda x: front(jnp.moveaxis(x, 0, 2).reshape(B, n * chunk, *x.shape[3:])[:, :T - 1])  # noqa: E731
    return tuple(join(x) for x in outs)


def shift_right(x: jax.Array) -> jax.Array:
    """x[:, t−1] at position t and 0 at t = 0: a per-position output (the critic's value of the
    prefix up to t−1 [B, T], or the logits of the next token [B, T, V]) aligned with the token it
    comes before."""
    chex.assert_rank(x, {2, 3})
    return jnp.pad(x[:, :-1], ((0, 0), (1, 0)) + ((0, 0),) * (x.ndim - 2))
