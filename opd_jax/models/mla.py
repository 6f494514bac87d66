"""GLM-5's attention: multi-head latent attention (MLA, DeepSeek-V2/V3) with DeepSeek sparse
attention (DSA, DeepSeek-V3.2) and the indexer shared across layers (GLM-5's IndexShare).

MLA. A token's keys and values come from one compressed latent c = RMSNorm(x·W_kv_a[:r]) of
kv_lora_rank r and one rotary key k_R = RoPE(x·W_kv_a[r:]) shared by every head; head i's key
is [c·W_uk_i, k_R] and its value c·W_uv_i (kv_b_proj holds W_uk and W_uv). Its query comes through
a low rank too: q_c = RMSNorm(x·W_q_a), q_i = q_c·W_q_b_i = [q_N_i, RoPE(q_R_i)]. Attention is
computed in the absorbed form: with q̃_i = q_N_i·W_uk_iᵀ (a vector of width r),

    score_i(t, s) = (q̃_i(t)·c(s) + q_R_i(t)·k_R(s)) / √(d_nope + d_rope)
    out_i(t) = (Σ_s softmax_s(score_i(t, ·)) c(s)) · W_uv_i

so keys are never expanded per head: a cache holds c and k_R per token (r + d_rope numbers, not
2·heads·head_dim), and every head reads the same gathered latents.

DSA. A lightning indexer scores every earlier token s for query t with
    I(t, s) = Σ_j w_j(t) · ReLU(q^I_j(t)·k^I(s) / √d_I),   w(t) = x(t)·W_w / √n_I,
(q^I from q_c, k^I = LayerNorm(x·W_k), both with RoPE on their first d_rope dimensions) and the
query attends only to the index_topk best (`indexer_topk`). Layers whose indexer type is "shared"
reuse the previous "full" layer's choice. The choice is discrete: no gradient reaches the indexer
through it (transformers runs it under no_grad; DeepSeek-V3.2 trains it apart, by a KL to dense
attention), and training leaves its weights as they are (`opd_jax.train` freezes them).

RoPE here is the interleaved kind of DeepSeek and GLM-5: dimensions (2i, 2i+1) turn together.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from opd_jax.models.masks import AttentionMask, allowed_at

# the latents' RMSNorms (q_a_layernorm, kv_a_layernorm) take no eps from config.json: theirs is fixed
LATENT_NORM_EPS = 1e-6
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked (padding) row stays NaN-free


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention's ranks and head widths (GLM-5: 2048, 512, 192, 64, 256)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field.name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """DSA's indexer: its heads and width, the keys each query keeps, and which layers run it
    ("full") or reuse the previous full layer's choice ("shared")."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        unknown = sorted(set(self.indexer_types) - {"full", "shared"})
        if unknown:
            raise ValueError(f"indexer_types may hold 'full' and 'shared' only, got {unknown[0]!r}")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a shared layer reuses an earlier layer's top-k")


def rope_interleaved(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [B, T, ..., D] (D = 2·len(inv_freq)) with pairs (x_2i, x_2i+1) turned by positions·inv_freq_i;
    positions [B, T]. The result lays the turned pairs out as transformers does, evens then odds:
    [x_2i·cos − x_2i+1·sin | x_2i+1·cos + x_2i·sin]: a layout shared by queries and keys, so their
    products are the interleaved rotation's. Angles in float32, cast to x's dtype first."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def rope_prefix(x: jax.Array, width: int, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x with `rope_interleaved` on its first `width` dimensions, the rest passed through (DSA's
    indexer queries and keys)."""
    return jnp.concatenate([rope_interleaved(x[..., :width], positions, inv_freq), x[..., width:]], axis=-1)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    """(x − mean) / sqrt(var + eps) · weight + bias over the last axis, in float32."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    out = (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return out.astype(x.dtype)


def index_scores(q: jax.Array, k: jax.Array, weights: jax.Array) -> jax.Array:
    """The indexer's I(t, s) = Σ_j weights_j(t) · ReLU(q_j(t)·k(s) / √d), in float32.

    q: [B, T, n_I, d] (RoPE applied), k: [B, S, d] (normed, RoPE applied), weights: [B, T, n_I]
    (already scaled by 1/√n_I). Returns [B, T, S]."""
    chex.assert_rank([q, k, weights], [4, 3, 3])
    scores = jnp.einsum("btjd,bsd->btjs", q.astype(jnp.float32), k.astype(jnp.float32)) * (q.shape[-1] ** -0.5)
    return jnp.einsum("btj,btjs->bts", weights.astype(jnp.float32), jax.nn.relu(scores))


def indexer_topk(scores: jax.Array, allowed: jax.Array, k: int) -> jax.Array:
    """The k keys [B, T, k] (int32) of highest index score among the `allowed` [B, T, S] ones,
    outside the gradient; where fewer than k are allowed, the rest are disallowed keys, which the
    attention masks out (`mla_attention`)."""
    chex.assert_equal_shape([scores, allowed])
    masked = jnp.where(allowed, jax.lax.stop_gradient(scores), -jnp.inf)
    return jax.lax.top_k(masked, k)[1].astype(jnp.int32)


def dense_scores(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, allowed: jax.Array,
                 scale: float) -> jax.Array:
    """Every head's attention logits over every key [B, T, n, S] in float32, (q_latent·c +
    q_R·k_R) · scale, MASKED where not `allowed` [B, T, S]."""
    f32 = jnp.float32
    scores = (jnp.einsum("btnr,bsr->btns", q_latent, latent, preferred_element_type=f32)
              + jnp.einsum("btnd,bsd->btns", q_rope, k_rope, preferred_element_type=f32)) * scale
    return jnp.where(allowed[:, :, None, :], scores, MASKED)


def mla_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                  allowed: jax.Array, scale: float, topk: jax.Array | None = None) -> jax.Array:
    """Absorbed-form attention over the latents: the per-head output in latent space [B, T, n, r]
    (multiply by W_uv for the values' width).

    q_latent: [B, T, n, r] (q_N·W_ukᵀ); q_rope: [B, T, n, d_R]; latent: [B, S, r]; k_rope:
    [B, S, d_R]; allowed: [B, T, S] (causality, padding, segments). topk: [B, T, k] key slots per
    query (DSA; -1: none): only those are gathered and attended over, where also allowed; None:
    every key."""
    chex.assert_rank([q_latent, q_rope, latent, k_rope, allowed], [4, 4, 3, 3, 3])
    f32 = jnp.float32
    if topk is None:
        probs = jax.nn.softmax(dense_scores(q_latent, q_rope, latent, k_rope, allowed, scale), axis=-1)
        probs = probs.astype(latent.dtype)
        return jnp.einsum("btns,bsr->btnr", probs, latent)
    slot = jnp.maximum(topk, 0)
    take = jax.vmap(lambda values, index: values[index])  # per row: [S, ...] at [T, k] -> [T, k, ...]
    chosen_latent, chosen_rope = take(latent, slot), take(k_rope, slot)  # [B, T, k, r], [B, T, k, d_R]
    keep = jnp.take_along_axis(allowed, slot, axis=-1) & (topk >= 0)  # [B, T, k]
    scores = (jnp.einsum("btnr,btkr->btnk", q_latent, chosen_latent, preferred_element_type=f32)
              + jnp.einsum("btnd,btkd->btnk", q_rope, chosen_rope, preferred_element_type=f32)) * scale
    scores = jnp.where(keep[:, :, None, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(latent.dtype)
    return jnp.einsum("btnk,btkr->btnr", probs, chosen_latent)


QUERY_CHUNK = 512  # queries attended together: a chunk's scores are [chunk, keys], not [T, keys]


def _by_query_chunks(fn, per_query: tuple, chunk: int):
    """fn over the queries (axis 1 of every array in `per_query`; None passes through) `chunk` at a
    time under lax.map, so per-chunk temporaries are O(chunk · keys); the outputs joined back. An
    `AttentionMask` among them reaches fn as its chunk's [B, chunk, S] matrix, made in the chunk."""
    masks = {i: x for i, x in enumerate(per_query) if isinstance(x, AttentionMask)}
    per_query = tuple((x.query_index, x.query_segment) if i in masks else x for i, x in enumerate(per_query))

    def run(q):
        if not masks:
            return fn(q)
        rows = {i: masks[i].rows(*q[i]) for i in masks}
        # tied to the chunk's queries: made of the mask alone, a chunk's matrix would be computed in
        # the forward and kept for the backward of a differentiated layer scan, every chunk's: T x S
        rows, first = jax.lax.optimization_barrier((rows, q[0]))
        return fn(tuple(rows[i] if i in masks else (first if i == 0 else x) for i, x in enumerate(q)))

    length = next(x for x in per_query if x is not None and not isinstance(x, tuple)).shape[1]
    if length <= chunk:
        return run(per_query)
    n = -(-length // chunk)
    pad = n * chunk - length  # padded queries are dropped after

    def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

    def join(y):  # [n, B, chunk, ...] -> [B, T, ...]
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], n * chunk, *y.shape[3:])[:, :length]

    return jax.tree.map(join, jax.lax.map(run, jax.tree.map(split, per_query)))


def chunked_topk(q_index: jax.Array, weights: jax.Array, keys: jax.Array, allowed: jax.Array | AttentionMask, k: int,
                 chunk: int = QUERY_CHUNK) -> jax.Array:
    """The indexer's choice [B, T, k] (`index_scores`, `indexer_topk`) for q^I [B, T, n_I, d_I],
    weights [B, T, n_I] and keys [B, S, d_I], `chunk` queries at a time (scores O(chunk · S))."""
    return _by_query_chunks(lambda q: indexer_topk(index_scores(q[0], keys, q[1]), q[2], k),
                            (q_index, weights, allowed), chunk)


def chunked_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                      allowed: jax.Array | AttentionMask, scale: float, topk: jax.Array | None = None,
                      chunk: int = QUERY_CHUNK) -> jax.Array:
    """`mla_attention` over the queries `chunk` at a time, so the scores of a long sequence take
    O(chunk · S) memory instead of O(T · S): output [B, T, n, r]."""
    return _by_query_chunks(lambda q: mla_attention(q[0], q[1], latent, k_rope, q[2], scale, q[3]),
                            (q_latent, q_rope, allowed, topk), chunk)


def index_kl(q_index: jax.Array, weights: jax.Array, keys: jax.Array, q_latent: jax.Array, q_rope: jax.Array,
             latent: jax.Array, k_rope: jax.Array, allowed: jax.Array | AttentionMask, scale: float,
             topk: jax.Array | None = None) -> jax.Array:
    """DeepSeek-V3.2's objective for the indexer, per query [B, T]:

        KL(t) = Σ_s p_t(s) · (log p_t(s) − log softmax_s(I(t, ·))(s)),
        p_t = Σ_h A_h(t, ·) / Σ_h Σ_s A_h(t, s)   (the attention's distribution, summed over heads)

    with A_h the absorbed-form attention of head h (`mla_attention`'s, without top-k) and I the
    indexer's scores (`index_scores`); p is a target (no gradient). Over every `allowed` key (the
    dense warm-up: the model attends them all) or, given `topk` [B, T, k] key slots (-1: none),
    over the chosen keys alone, p and the softmax renormalised there (the sparse stage). A query
    with no allowed key has KL 0. Float32."""
    chex.assert_rank([q_index, weights, keys, q_latent, q_rope, latent, k_rope], [4, 3, 3, 4, 4, 3, 3])

    def per_chunk(q):
        qi, w, ql, qr, ok, chosen = q
        target = jnp.sum(jax.nn.softmax(dense_scores(ql, qr, latent, k_rope, ok, scale), axis=-1), axis=2)  # [B, c, S]
        index = index_scores(qi, keys, w)
        if chosen is not None:
            slot = jnp.maximum(chosen, 0)
            ok = jnp.take_along_axis(ok, slot, axis=-1) & (chosen >= 0)
            target, index = (jnp.take_along_axis(x, slot, axis=-1) for x in (target, index))
        target = jnp.where(ok, target, 0.0)
        target = jax.lax.stop_gradient(target / jnp.maximum(jnp.sum(target, -1, keepdims=True), 1e-30))
        log_q = jax.nn.log_softmax(jnp.where(ok, index, MASKED), axis=-1)
        terms = jnp.where(ok & (target > 0), target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_q), 0.0)
        return jnp.sum(terms, axis=-1)

    return _by_query_chunks(per_chunk, (q_index, weights, q_latent, q_rope, allowed, topk), QUERY_CHUNK)


def key_offsets(topk: jax.Array, allowed: jax.Array | AttentionMask, query_index: jax.Array, key_index: jax.Array) -> jax.Array:
    """Index replay's record of a top-k choice: how many tokens back each chosen key is,
    query_index[t] − key_index[topk[t, j]] ([B, T, k] int32; -1 where the slot is not an allowed
    key). Offsets, not slots, so the record means the same in an engine's cache (slots, left
    padding, stored prefixes) and in a trainer's padded or packed row. query_index [B, T],
    key_index [B, S]: each query's and key slot's token index in its sequence."""
    slot = jnp.maximum(topk, 0)
    keep = allowed_at(allowed, slot) & (topk >= 0)
    back = query_index[:, :, None] - jnp.take_along_axis(key_index[:, None, :], slot, axis=-1)
    return jnp.where(keep, back, -1).astype(jnp.int32)


def replayed_topk(own: jax.Array, engine: jax.Array, use: jax.Array) -> jax.Array:
    """Index replay in a trainer's row (keys are its columns): the engine's choice (`engine`
    offsets [B, T, k], -1: none) where `use` [B, T], as columns t − offset (-1 kept: no key);
    this model's own top-k columns `own` elsewhere."""
    t = jnp.arange(own.shape[1], dtype=jnp.int32)[None, :, None]
    forced = jnp.where(engine >= 0, t - engine, -1)
    return jnp.where(use[:, :, None], forced, own).astype(jnp.int32)
