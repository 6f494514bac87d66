"""Context parallelism as a training forward sees it: its tokens split over a mesh axis, the
attention of each device's queries over every key.

The axis is whatever the logical-axis rules in force map "length" to (opd_jax.parallel's table
maps it to the mesh's sequence axis); it is never named here. Outside a mesh, or on a mesh whose
axis has one device, every function below is the identity or a plain call.

All-gather context parallelism (MaxText's default; Llama 3's): with the sequence split over n
devices, device i holds queries and keys of tokens [i·T/n, (i+1)·T/n). For the attention each
gathers every key and value (O(T·d) per layer, the activations' own size) and attends its own
queries to them, so the scores are [T/n, T] per device (blockwise: a block's). The causal mask
needs no change: queries and keys keep their global indices. The gather's transpose (a
reduce-scatter) sends each device the gradient of its own keys and values.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from opd_jax.models.masks import AttentionMask


def length_axis() -> str | None:
    """The mesh axis a training forward's tokens are split over, or None (no mesh, no rule for
    "length", or an axis of one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axis = nn.logical_to_mesh_axes(("length",))[0]
    if not isinstance(axis, str) or mesh.shape.get(axis, 1) == 1:
        return None
    return axis


def split_length(x: jax.Array) -> jax.Array:
    """x [B, T, ...] (the residual stream) constrained to be split along T over the length axis
    (the other dimensions left to the partitioner); x itself without one."""
    axis = length_axis()
    if axis is None:
        return x
    free = PartitionSpec.UNCONSTRAINED
    return jax.lax.with_sharding_constraint(x, PartitionSpec(free, axis, *([free] * (x.ndim - 2))))


def over_keys(attend: Callable[[jax.Array, jax.Array, jax.Array, AttentionMask], jax.Array],
              q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array:
    """attend(q, k, v, mask) (q [B, T, n, d], k [B, S, kv, d], v [B, S, kv, e] -> [B, T, n, e]) with
    the queries and keys split along T over the length axis: each device attends its queries to
    every key, all-gathered. T and S are padded up to a multiple of the axis size (padded queries
    attend nothing; padded keys are never attended). Without a length axis: attend(q, k, v, mask)."""
    axis = length_axis()
    if axis is None:
        return attend(q, k, v, mask)
    n = jax.sharding.get_abstract_mesh().shape[axis]
    T, S = q.shape[1], k.shape[1]
    q, qi, qs = (_pad(x, -T % n, fill) for x, fill in ((q, 0), (mask.query_index, -1), (mask.query_segment, -1)))
    k, v, ki, kvalid, ks = (_pad(x, -S % n, 0) for x in (k, v, mask.key_index, mask.key_valid, mask.key_segment))
    split = PartitionSpec(None, axis)

    def local(q, k, v, qi, qs, ki, kvalid, ks):
        gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
        return attend(q, gather(k), gather(v), AttentionMask(qi, gather(ki), gather(kvalid), qs, gather(ks)))

    specs = tuple(PartitionSpec() if x is None else split for x in (q, k, v, qi, qs, ki, kvalid, ks))
    # check_vma off: the attention's loops start from constants and would need every carry cast
    # to "varying" over the axis; each device's values are its own by construction here
    out = jax.shard_map(local, in_specs=specs, out_specs=split, axis_names={axis},
                        check_vma=False)(q, k, v, qi, qs, ki, kvalid, ks)
    return out[:, :T]


def _pad(x: jax.Array | None, pad: int, fill: int) -> jax.Array | None:
    if x is None or not pad:
        return x
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
