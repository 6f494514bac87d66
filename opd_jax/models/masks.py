"""Which keys each query of a training forward may attend, in O(T) numbers (`AttentionMask`), and
the few operations on a mask that take either it or the [B, T, S] matrix the cache paths use."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class AttentionMask:
    """Which keys each query attends, in O(T + S) numbers: key s is allowed for query t when

        key_valid[b, s]  and  key_index[b, s] <= query_index[b, t]  and  segment[b, s] == segment[b, t]

    (causal over the columns, padding keys never; segments: packed rows, a token attends only to
    its own sequence). query_index [B, T] and key_index / key_valid [B, S]; segments [B, T] of
    queries and keys (a forward's queries are its keys) or None."""

    query_index: jax.Array
    key_index: jax.Array
    key_valid: jax.Array
    query_segment: jax.Array | None = None
    key_segment: jax.Array | None = None

    @classmethod
    def causal(cls, valid: jax.Array, segments: jax.Array | None = None) -> AttentionMask:
        """A forward over [B, T] tokens: queries and keys are its columns; valid [B, T] its real tokens."""
        B, T = valid.shape
        column = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return cls(column, column, valid.astype(bool), segments, segments)

    def dense(self) -> jax.Array:
        """The [B, T, S] boolean matrix (O(T·S): for short sequences and the reference)."""
        return self.rows(self.query_index, self.query_segment)

    def rows(self, query_index: jax.Array, query_segment: jax.Array | None) -> jax.Array:
        """The [B, c, S] matrix of queries given by their index and segment (a chunk of this
        mask's queries) over this mask's keys."""
        return allowed_matrix(query_index, self.key_index, self.key_valid, query_segment, self.key_segment)

def allowed_matrix(q_index, k_index, k_valid, q_segment, k_segment) -> jax.Array:
    """[B, T, S] (or a block's [B, bq, bk]): which keys each query attends (`AttentionMask`)."""
    ok = k_valid[:, None, :] & (k_index[:, None, :] <= q_index[:, :, None])
    if q_segment is not None:
        ok = ok & (k_segment[:, None, :] == q_segment[:, :, None])
    return ok


def key_count(allowed: AttentionMask | jax.Array) -> int:
    """S: the keys a mask ranges over."""
    return allowed.key_index.shape[-1] if isinstance(allowed, AttentionMask) else allowed.shape[-1]


def allowed_at(allowed: AttentionMask | jax.Array, slot: jax.Array) -> jax.Array:
    """Whether each query may attend the key at `slot` [B, T, k] (in range): [B, T, k] bool."""
    if not isinstance(allowed, AttentionMask):
        return jnp.take_along_axis(allowed, slot, axis=-1)
    at = jax.vmap(lambda keys, index: keys[index])  # per row: [S] at [T, k]
    ok = at(allowed.key_valid, slot) & (at(allowed.key_index, slot) <= allowed.query_index[:, :, None])
    if allowed.query_segment is not None:
        ok = ok & (at(allowed.key_segment, slot) == allowed.query_segment[:, :, None])
    return ok
