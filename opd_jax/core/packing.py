"""Packed forwards: the trajectories of a batch laid end to end in fewer rows, so a forward spends
its compute on tokens rather than padding. Only the model's input is packed; every per-token
quantity (log-probs, values, masks, GAE) stays in the batch's own [B, T] layout, so the losses
and advantages do not change (`pack_tokens` in, `unpack` out).

The plan (host side, `plan_packing`): the rows of a batch are dealt into G groups by stride
(row b in group b mod G, as `update.split_rows` slices them), and each group's trajectories are
packed first-fit-decreasing into `rows_per_group` rows of `row_len` tokens. Trajectory b goes to
packed row  g + pack_row[b]·G  (g = b mod G) from column pack_offset[b]: a strided slice of the
batch (a mini- or micro-batch, n dividing G) is then itself a packed batch with G/n groups, and
the plan survives slicing unchanged. Inside a packed row, segment ids keep attention within a
trajectory and positions restart at each one.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.core.batch import BatchError, RolloutBatch


def plan_packing(lengths: np.ndarray, groups: int, row_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(pack_row [B], pack_offset [B], rows_per_group) for trajectories of `lengths` real tokens
    (each ≤ row_len) in `groups` strided groups (B divisible by groups). rows_per_group is the
    most any group needs, rounded up to a multiple of ⌈(B/groups)/8⌉ so a run sees few shapes
    (each one compiles), and never more than B/groups (packing never costs rows)."""
    lengths = np.asarray(lengths, np.int64)
    B = len(lengths)
    if groups < 1 or B % groups:
        raise ValueError(f"a batch of {B} rows does not split into {groups} packing groups")
    if lengths.size and lengths.max() > row_len:
        raise ValueError(f"a trajectory of {int(lengths.max())} tokens does not fit packed rows of {row_len}")
    per_group = B // groups
    pack_row, pack_offset = np.zeros(B, np.int32), np.zeros(B, np.int32)
    most = 1
    for g in range(groups):
        members = np.arange(g, B, groups)
        fill: list[int] = []  # tokens used in each of the group's rows so far
        # longest first, ties by row index: deterministic, so a resumed run packs the same way
        for b in sorted(members, key=lambda i: (-lengths[i], i)):
            row = next((r for r, used in enumerate(fill) if used + lengths[b] <= row_len), len(fill))
            if row == len(fill):
                fill.append(0)
            pack_row[b], pack_offset[b] = row, fill[row]
            fill[row] += int(lengths[b])
        most = max(most, len(fill))
    step = -(-per_group // 8)
    return pack_row, pack_offset, min(per_group, -(-most // step) * step)


def _flat_index(pack_row: jax.Array, pack_offset: jax.Array, valid: jax.Array, rows_per_group: int,
                seqs_per_group: int, row_len: int) -> tuple[jax.Array, int]:
    """For each batch token [B, T], its index into the packed rows flattened (R·row_len for a
    padding token, out of range), and R."""
    B, T = valid.shape
    if B % seqs_per_group:
        raise ValueError(f"a slice of {B} rows cuts packing groups of {seqs_per_group}: pack the batch into a "
                         "multiple of its mini- x micro-batches")
    groups = B // seqs_per_group
    R = groups * rows_per_group
    row = jnp.arange(B) % groups + pack_row * groups
    flat = row[:, None] * row_len + pack_offset[:, None] + jnp.arange(T)[None, :]
    return jnp.where(valid, flat, R * row_len), R


def pack_tokens(tokens: jax.Array, positions: jax.Array, valid: jax.Array, pack_row: jax.Array,
                pack_offset: jax.Array, layout: tuple[int, int, int], extra: Any = None,
                extra_fill: int = -1) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """The packed model input for a [B, T] batch whose real tokens (`valid`) start each row:
    tokens, positions and segment ids (b + 1 for trajectory b, 0 on padding), each [R, row_len],
    and `extra` (arrays [B, T, ...] or a pytree of them, e.g. an engine's routing) packed alike,
    `extra_fill` on padding.
    layout: (seqs_per_group, rows_per_group, row_len), as `plan_packing` made it."""
    chex.assert_equal_shape([tokens, positions, valid])
    seqs_per_group, rows_per_group, row_len = layout
    B = tokens.shape[0]
    flat, R = _flat_index(pack_row, pack_offset, valid, rows_per_group, seqs_per_group, row_len)
    size = R * row_len

    def scatter(x, fill):
        out = jnp.full((size, *x.shape[2:]), fill, x.dtype)
        return out.at[flat.reshape(-1)].set(x.reshape(flat.size, *x.shape[2:]), mode="drop")

    segment = jnp.broadcast_to(jnp.arange(1, B + 1, dtype=jnp.int32)[:, None], tokens.shape)
    packed = [scatter(x, 0).reshape(R, row_len) for x in (tokens, positions, segment)]
    packed_extra = jax.tree.map(lambda x: scatter(x, extra_fill).reshape(R, row_len, *x.shape[2:]), extra)
    return (*packed, packed_extra)


def unpack(packed: jax.Array, pack_row: jax.Array, pack_offset: jax.Array, valid: jax.Array,
           layout: tuple[int, int, int]) -> jax.Array:
    """A per-token output of the packed forward [R, row_len, ...] back in the batch's layout
    [B, T, ...], zero on padding."""
    seqs_per_group, rows_per_group, row_len = layout
    flat, R = _flat_index(pack_row, pack_offset, valid, rows_per_group, seqs_per_group, row_len)
    chex.assert_shape(packed, (R, row_len, ...))
    rows = packed.reshape(R * row_len, *packed.shape[2:])
    out = jnp.take(rows, jnp.minimum(flat, R * row_len - 1), axis=0)
    keep = valid.reshape(*valid.shape, *(1,) * (packed.ndim - 2))
    return jnp.where(keep, out, jnp.zeros((), packed.dtype))


def pack_batch(batch: RolloutBatch, groups: int, row_len: int | None = None) -> RolloutBatch:
    """The batch with a packing plan for its forwards (host side): `groups` strided groups (a
    multiple of every row split the step makes: data shards × mini- × micro-batches), rows of
    `row_len` tokens (default: the batch's own length T)."""
    mask = np.asarray(batch.attention_mask).astype(bool)
    lengths = mask.sum(1)
    if np.any(mask != (np.arange(mask.shape[1])[None, :] < lengths[:, None])):
        raise BatchError("packing needs each row's real tokens first and its padding after them")
    row_len = row_len or mask.shape[1]
    pack_row, pack_offset, rows_per_group = plan_packing(lengths, groups, row_len)
    return batch.replace(pack_row=jnp.asarray(pack_row), pack_offset=jnp.asarray(pack_offset),
                         packing=(len(lengths) // groups, rows_per_group, row_len))
