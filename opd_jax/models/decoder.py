"""The decoder-only transformer shared by the Llama, Qwen2 and Qwen3 families and the MoE
Qwen3-MoE, GLM-4.5 and GLM-5 families, in Flax NNX (GLM-5's latent attention and sparse
attention's indexer: `opd_jax.models.mla`).

Layer weights are stacked along a leading "layers" axis and the forward pass is one `lax.scan`
over them, so a 30-layer model compiles as fast as a 1-layer one. Every parameter carries
`logical_axes` metadata (e.g. ("layers", "embed", "heads", "head_dim")); the sharding rules in
`opd_jax.parallel` map those names onto mesh axes, and nothing here names a mesh axis.

Attention is causal over cache *slots*, with a per-slot validity mask: the same code serves a
plain forward (slots = the T input tokens), a prefill into a KV cache, and one-token decoding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.models.attention import AttentionMask, attention, dense_attention
from opd_jax.models.config import ModelConfig
from opd_jax.models.context import split_length
from opd_jax.models.execution import Execution
from opd_jax.models.lora import Adapting, LoraConfig, add_adapters, base_name, merge_adapters, project
from opd_jax.models.masks import key_count
from opd_jax.models.mla import (
    LATENT_NORM_EPS,
    chunked_attention,
    chunked_topk,
    index_kl,
    key_offsets,
    layer_norm,
    replayed_topk,
    rope_interleaved,
    rope_prefix,
)
from opd_jax.models.moe import RouterInfo, experts_ragged, flip_fraction, route, router_stats
from opd_jax.models.rope import apply_rope, inverse_frequencies


@flax.struct.dataclass
class KVCache:
    """Keys/values per layer and slot, which slots hold real tokens, and how many are filled.

    k, v: [layers, B, S, kv_heads, head_dim] (an MLA model's k: [layers, B, S, 1, kv_lora_rank +
    qk_rope_head_dim], each token's latent and rotary key; its v: [layers, B, S, 1, index_head_dim],
    the indexer's key, zero in the layers that reuse another's top-k); valid: [B, S] bool; length: the number of slots
    written so far, an int32 scalar (the same for every row: prompts are left-padded) or [B], one
    per row (continuous batching: each row is a request of its own, admitted at its own time). A
    float8 cache
    keeps each (token, head) vector scaled into e4m3's range, its scale in k_scale / v_scale
    [layers, B, S, kv_heads] (float32): k ≈ k_fp8 · k_scale (`_to_cache`, `_from_cache`).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    length: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, slots: int, dtype: Any) -> KVCache:
        shapes = [(config.num_layers, batch, slots, *entry) for entry in config.cache_entries]
        # two buffers, not one twice: a donated cache must not alias its k and v scales
        scales = tuple(jnp.ones(s[:-1], jnp.float32) for s in shapes) if _is_fp8(dtype) else (None, None)
        return cls(k=jnp.zeros(shapes[0], dtype), v=jnp.zeros(shapes[1], dtype), valid=jnp.zeros((batch, slots), bool),
                   length=jnp.zeros((), jnp.int32), k_scale=scales[0], v_scale=scales[1])

    @property
    def slots(self) -> int:
        return self.k.shape[2]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight · x / sqrt(mean(x², -1) + eps), the mean taken in float32."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any, axes: tuple[str, ...], kind: str = "normal"):
    if kind == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif kind == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class LayerStack(nnx.Module):
    """All decoder layers' weights, each stacked along a leading layer axis: attention and norms
    over every layer; the dense MLP over the dense layers; router and experts over the MoE layers
    (`config.moe_layers`), each expert weight with an "expert" axis."""

    def __init__(self, config: ModelConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        L, H, I = config.num_layers, config.hidden_size, config.intermediate_size
        p = lambda shape, axes, kind="normal": _init(rngs, shape, param_dtype, axes, kind)  # noqa: E731
        self.attn_norm = p((L, H), ("layers", "norm"), "ones")
        if config.mla is not None:
            self._latent_attention(config, p)
        else:
            self._attention(config, p)
        self.mlp_norm = p((L, H), ("layers", "norm"), "ones")
        Ld = len(config.dense_layers)
        if Ld:
            self.gate = p((Ld, H, I), ("layers", "embed", "mlp"))
            self.up = p((Ld, H, I), ("layers", "embed", "mlp"))
            self.down = p((Ld, I, H), ("layers", "mlp", "embed"))
        if config.moe is not None:
            m, Lm = config.moe, len(config.moe_layers)
            E, Im = m.num_experts, m.intermediate_size
            self.router = p((Lm, H, E), ("layers", "embed", "expert_scores"))
            if m.score_correction_bias:
                self.router_bias = p((Lm, E), ("layers", "expert_scores"), "zeros")
            self.expert_gate = p((Lm, E, H, Im), ("layers", "expert", "embed", "mlp"))
            self.expert_up = p((Lm, E, H, Im), ("layers", "expert", "embed", "mlp"))
            self.expert_down = p((Lm, E, Im, H), ("layers", "expert", "mlp", "embed"))
            if m.num_shared_experts:
                Is = m.num_shared_experts * Im
                self.shared_gate = p((Lm, H, Is), ("layers", "embed", "mlp"))
                self.shared_up = p((Lm, H, Is), ("layers", "embed", "mlp"))
                self.shared_down = p((Lm, Is, H), ("layers", "mlp", "embed"))

    def _attention(self, config: ModelConfig, p) -> None:
        """Grouped-query attention's projections (and the biases and q/k norms of some families)."""
        L, H = config.num_layers, config.hidden_size
        n, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.q = p((L, H, n, d), ("layers", "embed", "heads", "head_dim"))
        self.k = p((L, H, kv, d), ("layers", "embed", "kv_heads", "head_dim"))
        self.v = p((L, H, kv, d), ("layers", "embed", "kv_heads", "head_dim"))
        self.o = p((L, n, d, H), ("layers", "heads", "head_dim", "embed"))
        if config.qkv_bias:
            self.q_bias = p((L, n, d), ("layers", "heads", "head_dim"), "zeros")
            self.k_bias = p((L, kv, d), ("layers", "kv_heads", "head_dim"), "zeros")
            self.v_bias = p((L, kv, d), ("layers", "kv_heads", "head_dim"), "zeros")
        if config.o_bias:
            self.o_bias = p((L, H), ("layers", "norm"), "zeros")
        if config.qk_norm:
            self.q_norm = p((L, d), ("layers", "norm"), "ones")
            self.k_norm = p((L, d), ("layers", "norm"), "ones")

    def _latent_attention(self, config: ModelConfig, p) -> None:
        """MLA's projections over every layer and DSA's indexer over the layers that run it
        (`config.indexer_layers`; their names start with "index_")."""
        L, H, n, m = config.num_layers, config.hidden_size, config.num_heads, config.mla
        self.q_a = p((L, H, m.q_lora_rank), ("layers", "embed", "q_lora"))
        self.q_a_norm = p((L, m.q_lora_rank), ("layers", "norm"), "ones")
        self.q_b = p((L, m.q_lora_rank, n, m.qk_head_dim), ("layers", "q_lora", "heads", "head_dim"))
        self.kv_a = p((L, H, m.kv_lora_rank + m.qk_rope_head_dim), ("layers", "embed", "kv_lora"))
        self.kv_a_norm = p((L, m.kv_lora_rank), ("layers", "norm"), "ones")
        self.kv_b = p((L, m.kv_lora_rank, n, m.qk_nope_head_dim + m.v_head_dim), ("layers", "kv_lora", "heads",
                                                                                  "head_dim"))
        self.o = p((L, n, m.v_head_dim, H), ("layers", "heads", "head_dim", "embed"))
        Li, dsa = len(config.indexer_layers), config.dsa
        self.index_q = p((Li, m.q_lora_rank, dsa.index_n_heads, dsa.index_head_dim),
                         ("layers", "q_lora", "index_heads", "index_dim"))
        self.index_k = p((Li, H, dsa.index_head_dim), ("layers", "embed", "index_dim"))
        self.index_k_norm = p((Li, dsa.index_head_dim), ("layers", "norm"), "ones")
        self.index_k_norm_bias = p((Li, dsa.index_head_dim), ("layers", "norm"), "zeros")
        self.index_weights = p((Li, H, dsa.index_n_heads), ("layers", "embed", "index_heads"))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


_DENSE_MLP = ("gate", "up", "down")
_MOE_MLP = ("router", "router_bias", "expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up",
            "shared_down")


def _adapting(config: ModelConfig, adapter_ids: jax.Array | None, dropout_key: jax.Array | None) -> Adapting:
    if config.lora is None:
        return Adapting()
    return Adapting(config.lora.scale, adapter_ids, config.lora.dropout, dropout_key if config.lora.dropout else None)


def _dense_mlp(h: jax.Array, w: dict[str, jax.Array], lora: Adapting = Adapting()) -> jax.Array:
    gated = jax.nn.silu(project("bth,hi->bti", h, w, "gate", lora)) * project("bth,hi->bti", h, w, "up", lora)
    return project("bti,ih->bth", gated, w, "down", lora)


def _moe_mlp(config: ModelConfig, h: jax.Array, w: dict[str, jax.Array], forced: jax.Array | None,
             replay: jax.Array | None, valid: jax.Array, lora: Adapting = Adapting()
             ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Routed experts (+ shared experts) on h [B, T, H]; returns the output and (expert ids used
    [B, T, k], f [E], P [E], z-loss, flip fraction) over the valid [B, T] tokens (`router_stats`).
    forced: an engine's expert ids [B, T, k] (-1 where it has none): used where replay [B, T]
    is set (routing replay), and compared with this model's own choice (the flip fraction)."""
    B, T, H = h.shape
    routed = merge_adapters({k: v for k, v in w.items() if k.startswith("expert_")}, lora.scale)
    w = {**{k: v for k, v in w.items() if not k.startswith("expert_")}, **routed}  # ragged matmuls take whole weights
    flat = h.reshape(B * T, H)
    logits = jnp.einsum("nh,he->ne", flat.astype(jnp.float32), w["router"].astype(jnp.float32))
    ids, gates = route(logits, config.moe, w.get("router_bias"))
    flips = jnp.zeros((), jnp.float32)
    if forced is not None:
        engine = forced.reshape(B * T, -1)
        available = (engine[:, 0] >= 0) & valid.reshape(-1)
        flips = flip_fraction(ids, engine, available)
        chosen = jnp.where((replay.reshape(-1) & available)[:, None], engine, ids)
        ids, gates = route(logits, config.moe, w.get("router_bias"), forced=chosen)
    out = experts_ragged(flat, ids, gates, w["expert_gate"], w["expert_up"], w["expert_down"]).reshape(B, T, H)
    if "shared_gate" in w:
        shared = {k.removeprefix("shared_"): v for k, v in w.items() if k.startswith("shared_")}
        out = out + _dense_mlp(h, shared, lora)
    return out, (ids.reshape(B, T, -1), *router_stats(logits, ids, valid.reshape(-1)), flips)


def _spans(slots: int, step: int = 128, most: int = 8) -> list[int]:
    """The slot counts cache attention is compiled for: multiples of `step` (at most `most` of
    them) up to `slots`, the last `slots` itself."""
    step = max(step, -(-slots // most // step) * step)
    return sorted({min(slots, s) for s in range(step, slots + step, step)})


def _cache_attention(q: jax.Array, cache_kv: tuple, layer: jax.Array, allowed: jax.Array, filled: jax.Array,
                     dtype: Any) -> jax.Array:
    """_attention of q over one layer of the cache, read only up to the smallest span of `_spans`
    that holds the `filled` slots written so far. Every slot after them is masked out of
    `allowed`, so the result is the full range's, while a decode step early in a long response
    reads a fraction of the cache (its cost grows with the slots read: on a CPU, most of a long
    response's decode step)."""
    cache_k, cache_v, k_scale, v_scale = cache_kv
    B, S = cache_k.shape[1:3]

    def attend(span: int) -> jax.Array:
        def read(x: jax.Array | None) -> jax.Array | None:
            if x is None:
                return None
            start = (layer, 0, 0) + (0,) * (x.ndim - 3)
            return jax.lax.dynamic_slice(x, start, (1, B, span) + x.shape[3:])[0]
        k = _from_cache(read(cache_k), read(k_scale), dtype)
        v = _from_cache(read(cache_v), read(v_scale), dtype)
        return dense_attention(q, k, v, allowed[..., :span])

    spans = _spans(S)
    if len(spans) == 1:
        return attend(S)
    index = jnp.searchsorted(jnp.asarray(spans), filled)  # the first span >= filled
    return jax.lax.switch(jnp.minimum(index, len(spans) - 1), [functools.partial(attend, s) for s in spans])


def _is_fp8(dtype: Any) -> bool:
    return jnp.dtype(dtype) == jnp.float8_e4m3fn


def _to_cache(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array | None]:
    """x [..., head_dim] as the cache stores it: cast, or for float8 scaled per vector so its
    largest entry lands on e4m3's largest value (448): (x / s, s) with s = max|x| / 448."""
    if not _is_fp8(dtype):
        return x.astype(dtype), None
    scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1), 1e-12) / float(jnp.finfo(dtype).max)
    return (x.astype(jnp.float32) / scale[..., None]).astype(dtype), scale


def _from_cache(x: jax.Array, scale: jax.Array | None, dtype: Any) -> jax.Array:
    return x.astype(dtype) if scale is None else (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


def _write_cache(cache_kv: tuple, new: tuple[jax.Array, jax.Array], layer: jax.Array, write_at: jax.Array) -> tuple:
    """The cache arrays (k, v, k_scale, v_scale) with one layer's new entries new = (k, v)
    [B, T, heads, width] written in place at [layer, :, write_at] (one position, or one per row)."""
    stored = []
    for entry, cache, scales in zip(new, cache_kv[:2], cache_kv[2:]):
        value, value_scale = _to_cache(entry, cache.dtype)
        stored_dtype = cache.dtype
        if stored_dtype.itemsize < 4:  # written as raw bits: XLA:CPU updates a float8 or 16-bit
            # float array by converting all of it (the whole cache, every layer, every step)
            bits = {1: jnp.uint8, 2: jnp.uint16}[stored_dtype.itemsize]
            cache, value = (jax.lax.bitcast_convert_type(x, bits) for x in (cache, value))
        if write_at.ndim == 0:
            cache = jax.lax.dynamic_update_slice(cache, value[None], (layer, 0, write_at, 0, 0))
            if scales is not None:
                scales = jax.lax.dynamic_update_slice(scales, value_scale[None], (layer, 0, write_at, 0))
        else:  # a slot per row: scatter each row's T new entries at its own write position
            at_row = jnp.arange(value.shape[0])[:, None]
            cols = write_at[:, None] + jnp.arange(value.shape[1])[None]
            cache = cache.at[layer, at_row, cols].set(value, mode="drop")
            if scales is not None:
                scales = scales.at[layer, at_row, cols].set(value_scale, mode="drop")
        stored.append((jax.lax.bitcast_convert_type(cache, stored_dtype), scales))
    (cache_k, k_scale), (cache_v, v_scale) = stored
    return cache_k, cache_v, k_scale, v_scale


def _read_cache(cache_kv: tuple, layer: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """One layer's cached (k, v) [B, S, heads, width], every slot, as `dtype`."""
    cache_k, cache_v, k_scale, v_scale = cache_kv
    return tuple(_from_cache(x[layer], None if scale is None else scale[layer], dtype)
                 for x, scale in ((cache_k, k_scale), (cache_v, v_scale)))


def _attention_block(config: ModelConfig, w: dict[str, jax.Array], x: jax.Array, positions: jax.Array,
                     inv_freq: jax.Array, allowed: jax.Array | AttentionMask, cache_kv: tuple | None,
                     layer: jax.Array | None, write_at: jax.Array | None, lora: Adapting = Adapting(),
                     execution: Execution = Execution()):
    """x + attention(norm(x)). With a cache (k, v, k_scale, v_scale), k/v are written into the
    all-layer cache arrays in place (at [layer, :, write_at]) and the layer's slots written so far
    are attended over, as the cache holds them (`_cache_attention`); without one, where the
    forward's AttentionMask allows, as `execution.attention` says."""
    dt = x.dtype
    h = rms_norm(x, w["attn_norm"], config.rms_norm_eps)
    q, k, v = (project("bth,hnd->btnd", h, w, name, lora) for name in ("q", "k", "v"))
    if config.qkv_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, w["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], config.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    if cache_kv is not None:
        cache_kv = _write_cache(cache_kv, (k, v), layer, write_at)
        attn = _cache_attention(q, cache_kv, layer, allowed, jnp.max(write_at) + q.shape[1], dt)
    else:
        attn = attention(q, k, v, allowed, execution.attention, execution.attention_block)
    out = project("btnd,ndh->bth", attn, w, "o", lora)
    if config.o_bias:
        out = out + w["o_bias"]
    return x + out, cache_kv


def _index_queries(config: ModelConfig, w: dict[str, jax.Array], h: jax.Array, q_c: jax.Array,
                   positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """DSA's indexer queries q^I [B, T, n_I, d_I] (RoPE on the first qk_rope_head_dim) and head
    weights w [B, T, n_I] (already / √n_I) for h [B, T, hidden] and its low-rank query q_c, from
    one full layer's indexer weights `w` ("index_*")."""
    q = rope_prefix(jnp.einsum("btr,rjd->btjd", q_c, w["index_q"]), config.mla.qk_rope_head_dim, positions, inv_freq)
    weights = jnp.einsum("bth,hj->btj", h, w["index_weights"]).astype(jnp.float32) * config.dsa.index_n_heads ** -0.5
    return q, weights


def index_keys(config: ModelConfig, w: dict[str, jax.Array], h: jax.Array, positions: jax.Array,
               inv_freq: jax.Array) -> jax.Array:
    """The indexer's keys [B, T, d_I] of h: LayerNorm(h·W_k), RoPE on the first qk_rope_head_dim."""
    k = layer_norm(jnp.einsum("bth,hd->btd", h, w["index_k"]), w["index_k_norm"], w["index_k_norm_bias"])
    return rope_prefix(k, config.mla.qk_rope_head_dim, positions, inv_freq)


def _latent_attention_block(config: ModelConfig, w: dict[str, jax.Array], index_w: dict[str, jax.Array] | None,
                            x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                            allowed: jax.Array | AttentionMask, topk: jax.Array | None, token_index: tuple[jax.Array, jax.Array],
                            cache_kv: tuple | None = None, layer: jax.Array | None = None,
                            write_at: jax.Array | None = None, lora: Adapting = Adapting(),
                            engine: jax.Array | None = None, replay: jax.Array | None = None,
                            valid: jax.Array | None = None, index_loss: str | None = None,
                            execution: Execution = Execution()
                            ) -> tuple[jax.Array, tuple | None, jax.Array | None, jax.Array | None, jax.Array, jax.Array]:
    """x + MLA(norm(x)) (`opd_jax.models.mla`); returns it, the cache, the top-k key slots it
    attended (DSA; None where every key is attended: top-k ≥ the keys), and for a layer that runs
    its indexer (`index_w`) its own choice as offsets (`mla.key_offsets`; token_index = each
    query's and key slot's token index) and the share of the `valid` [B, T] tokens with an engine
    record (`engine` offsets [B, T, k]) whose set differs from this choice. A shared layer attends
    the `topk` given (the previous full layer's). Index replay: where `replay` [B, T], the engine's
    choice is attended instead of this model's (`mla.replayed_topk`; a trainer's row only).
    Training the indexer (`index_loss`, an indexer layer without a cache): its KL to the attention
    (`mla.index_kl`) over the `valid` queries, as [Σ KL, count] (zeros elsewhere), its inputs cut
    from the model's graph so that only the KL moves it; "dense": every key attended and the KL
    over them all (DeepSeek-V3.2's dense warm-up), "sparse": the top-k attended and the KL over it.

    Without a cache the keys are the sequence's own. With one, the layer's latent and rotary key
    ([c ‖ k_R], one vector per token) are written into its k and, for an indexer layer, the
    indexer's key into its v, at [layer, :, write_at], and the queries attend over every slot the
    cache holds (`allowed` [B, T, slots]); without one, `allowed` is the forward's AttentionMask and
    a layer attending every key goes through `execution.attention` (`_absorbed_attention`)."""
    m = config.mla
    h = rms_norm(x, w["attn_norm"], config.rms_norm_eps)
    q_c = rms_norm(project("bth,hr->btr", h, w, "q_a", lora), w["q_a_norm"], LATENT_NORM_EPS)
    q = project("btr,rnd->btnd", q_c, w, "q_b", lora)
    q_nope, q_rope = q[..., :m.qk_nope_head_dim], rope_interleaved(q[..., m.qk_nope_head_dim:], positions, inv_freq)
    compressed = project("bth,hc->btc", h, w, "kv_a", lora)
    latent = rms_norm(compressed[..., :m.kv_lora_rank], w["kv_a_norm"], LATENT_NORM_EPS)
    k_rope = rope_interleaved(compressed[..., m.kv_lora_rank:], positions, inv_freq)
    keys = None
    if cache_kv is not None:
        # an indexer layer caches its keys whatever this call's top-k: a stored prefix may serve a longer
        # cache, where the top-k leaves keys out; a shared layer keeps none (its v stays zero)
        own_keys = (index_keys(config, index_w, h, positions, inv_freq) if index_w is not None
                    else jnp.zeros(x.shape[:2] + (config.dsa.index_head_dim,), x.dtype))
        cache_kv = _write_cache(cache_kv, (jnp.concatenate([latent, k_rope], -1)[:, :, None], own_keys[:, :, None]),
                                layer, write_at)
        stored, keys = _read_cache(cache_kv, layer, x.dtype)
        latent, k_rope, keys = stored[:, :, 0, :m.kv_lora_rank], stored[:, :, 0, m.kv_lora_rank:], keys[:, :, 0]
    kv_b = merge_adapters({k: v for k, v in w.items() if base_name(k) == "kv_b"}, lora.scale)["kv_b"]
    w_uk, w_uv = kv_b[..., :m.qk_nope_head_dim], kv_b[..., m.qk_nope_head_dim:]
    q_latent = jnp.einsum("btnd,rnd->btnr", q_nope, w_uk)
    scale = m.qk_head_dim ** -0.5
    offsets, flips, kl = None, jnp.zeros((), jnp.float32), jnp.zeros((2,), jnp.float32)
    chooses = config.dsa is not None and config.dsa.index_topk < key_count(allowed) and index_loss != "dense"
    if index_w is not None and (chooses or index_loss is not None):
        cut = jax.lax.stop_gradient if index_loss is not None else (lambda a: a)
        if keys is None:
            keys = index_keys(config, index_w, cut(h), positions, inv_freq)
        q_index, weights = _index_queries(config, index_w, cut(h), cut(q_c), positions, inv_freq)
        if chooses:
            topk = chunked_topk(q_index, weights, keys, allowed, config.dsa.index_topk)
            offsets = key_offsets(topk, allowed, *token_index)
        if engine is not None and offsets is not None:
            available = (engine[..., 0] >= 0) & valid
            k = engine.shape[-1]
            flips = flip_fraction(offsets.reshape(-1, k), engine.reshape(-1, k), available.reshape(-1))
            topk = replayed_topk(topk, engine, replay & available)
        if index_loss is not None:
            per_query = index_kl(q_index, weights, keys, *(cut(a) for a in (q_latent, q_rope, latent, k_rope)),
                                 allowed, scale, topk)
            kl = jnp.stack([jnp.sum(jnp.where(valid, per_query, 0.0)), jnp.sum(valid).astype(jnp.float32)])
    if topk is None and isinstance(allowed, AttentionMask):  # a training forward attending every key
        out = _absorbed_attention(q_latent, q_rope, latent, k_rope, allowed, scale, execution)
    else:
        out = chunked_attention(q_latent, q_rope, latent, k_rope, allowed, scale, topk)
    values = jnp.einsum("btnr,rnv->btnv", out, w_uv)
    return x + project("btnv,nvh->bth", values, w, "o", lora), cache_kv, topk, offsets, flips, kl


def _absorbed_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                        mask: AttentionMask, scale: float, execution: Execution) -> jax.Array:
    """`mla.mla_attention` (every allowed key) as attention with one key head, through
    `execution.attention` (blockwise: O(T) memory): queries [q_latent ‖ q_R], each token's key
    [c ‖ k_R] and value c, the scale folded into the queries (attention divides by √width)."""
    q = jnp.concatenate([q_latent, q_rope], -1)
    q = q * jnp.asarray(scale * q.shape[-1] ** 0.5, q.dtype)
    k = jnp.concatenate([latent, k_rope], -1)[:, :, None]
    return attention(q, k, latent[:, :, None], mask, execution.attention, execution.attention_block)


def _segments(config: ModelConfig) -> list[tuple[str, int, int, int]]:
    """Runs of consecutive layers of one kind: (kind, first layer, end layer, the run's first
    index in its kind's stack). A dense model is one run; GLM-4.5 (dense layers first) is two."""
    runs: list[tuple[str, int, int, int]] = []
    moe = set(config.moe_layers)
    seen = {"dense": 0, "moe": 0}
    for i in range(config.num_layers):
        kind = "moe" if i in moe else "dense"
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], i + 1, runs[-1][3])
        else:
            runs.append((kind, i, i + 1, seen[kind]))
        seen[kind] += 1
    return runs


class Backbone(nnx.Module):
    """Embedding, the layer stack and the final norm: everything but the output head."""

    def __init__(self, config: ModelConfig, *, param_dtype: Any = jnp.float32, compute_dtype: Any = None,
                 rngs: nnx.Rngs):
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype or param_dtype).name
        self.execution = Execution()  # how the training forward computes (`set_execution`)
        self.embed = _init(rngs, (config.vocab_size, config.hidden_size), param_dtype, ("vocab", "embed"))
        self.layers = LayerStack(config, param_dtype=param_dtype, rngs=rngs)
        self.final_norm = _init(rngs, (config.hidden_size,), param_dtype, ("norm",), "ones")

    def forward(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                attention_mask: jax.Array | None = None, unroll: int | bool = 1, routing: jax.Array | None = None,
                replay: jax.Array | None = None, segment_ids: jax.Array | None = None,
                adapter_ids: jax.Array | None = None, dropout_key: jax.Array | None = None,
                indices: jax.Array | None = None, replay_indices: jax.Array | None = None,
                index_loss: str | None = None) -> tuple[jax.Array, RouterInfo | None]:
        """The training forward, without a cache: (final hidden states [B, T, hidden], RouterInfo
        of a MoE model or None).

        tokens: int [B, T]. positions: int [B, T], default 0..T-1. attention_mask: [B, T], 1 for
        real tokens; padding keys are never attended to. unroll: layers per scan iteration (True:
        all). Unrolling compiles slower but lets XLA fuse across layers; it pays off in training
        steps (the backward of a scan is slower). MoE models: routing [B, T, moe layers, k], an
        engine's expert ids (-1: none), used where replay [B, T] is set (default: everywhere;
        routing replay, R3) and compared with this model's own routing (RouterInfo.flip_fraction)
        everywhere; the RouterInfo holds the expert ids used and the routers' statistics per MoE
        layer. segment_ids: int [B, T], packed rows: a token attends only to earlier tokens of its
        own segment (give positions restarting at each segment). adapter_ids: int [B], a model
        whose adapters are a bank (`lora.bank`): the adapter each row runs with. dropout_key: a
        training pass's key for the adapters' dropout (`LoraConfig.dropout`; none without it).
        DSA models: indices [B, T, indexer layers, k], an engine's top-k per token as offsets back
        (`mla.key_offsets`; -1: none), attended instead of this model's choice where replay_indices
        [B, T] is set (default: nowhere; index replay) and compared with it everywhere
        (RouterInfo.index_flips); the RouterInfo holds this model's own choices (index_offsets).
        index_loss ("dense" or "sparse"): the indexers' KL to the attention, to train them
        (RouterInfo.index_kl; `_latent_attention_block`); "dense" attends every key.
        """
        chex.assert_rank(tokens, 2)
        B, T = tokens.shape
        positions, mask = self._positions_and_mask(tokens, positions, attention_mask)
        if segment_ids is not None:
            chex.assert_shape(segment_ids, (B, T))
        allowed = AttentionMask.causal(mask, segment_ids)  # a row's keys are its columns
        hidden, _, info = self._layers(tokens, positions, mask, allowed, None, None, unroll, routing, replay,
                                       _adapting(self.config, adapter_ids, dropout_key),
                                       (allowed.query_index, allowed.key_index),
                                       indices, replay_indices, index_loss)
        return hidden, info

    def extend(self, tokens: jax.Array, cache: KVCache, *, positions: jax.Array,
               attention_mask: jax.Array | None = None) -> tuple[jax.Array, KVCache, RouterInfo | None]:
        """Generation through a KV cache, prefill and decode alike (both append T tokens to what
        the cache holds): (final hidden states [B, T, hidden], the updated cache, RouterInfo or
        None). The T tokens are written at slots cache.length .. cache.length+T-1 (one length for
        the batch, or one per row: continuous batching's slots) and attend to every earlier valid
        slot. positions and attention_mask as `forward`'s."""
        chex.assert_rank(tokens, 2)
        B, T = tokens.shape
        positions, mask = self._positions_and_mask(tokens, positions, attention_mask)
        write_at = cache.length
        if write_at.ndim == 0:
            key_valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, write_at))
            query_slot = write_at + jnp.arange(T)[None]
        else:  # each row writes at its own slot
            query_slot = write_at[:, None] + jnp.arange(T)[None]
            key_valid = cache.valid.at[jnp.arange(B)[:, None], query_slot].set(mask, mode="drop")
        allowed = key_valid[:, None, :] & (jnp.arange(cache.slots)[None, None, :] <= query_slot[:, :, None])
        kv = (cache.k, cache.v, cache.k_scale, cache.v_scale)
        key_index = jnp.cumsum(key_valid, axis=1, dtype=jnp.int32) - 1  # a slot's token index in its row
        token_index = (jnp.take_along_axis(key_index, jnp.minimum(query_slot, cache.slots - 1), axis=1), key_index)
        hidden, kv, info = self._layers(tokens, positions, mask, allowed, kv, write_at, 1, None, None,
                                        _adapting(self.config, None, None), token_index, None, None)
        return hidden, KVCache(k=kv[0], v=kv[1], valid=key_valid, length=cache.length + T, k_scale=kv[2],
                               v_scale=kv[3]), info

    @staticmethod
    def _positions_and_mask(tokens: jax.Array, positions: jax.Array | None,
                            attention_mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask = jnp.ones((B, T), bool) if attention_mask is None else attention_mask.astype(bool)
        chex.assert_shape([positions, mask], (B, T))
        return positions, mask

    def _layers(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array, allowed: jax.Array, kv: Any,
                write_at: jax.Array | None, unroll: int | bool, routing: jax.Array | None,
                replay: jax.Array | None, lora: Adapting, token_index: tuple[jax.Array, jax.Array],
                indices: jax.Array | None, replay_indices: jax.Array | None, index_loss: str | None = None
                ) -> tuple[jax.Array, Any, RouterInfo | None]:
        """Embedding, every layer (attention where `allowed` [B, T, keys]; keys and values written
        into `kv` at `write_at` when there is a cache) and the final norm. token_index: each
        query's and key slot's token index (DSA's offsets)."""
        B, T = tokens.shape
        config = self.config
        execution = self.execution
        dt = jnp.dtype(self.compute_dtype)
        x = self.embed[...].astype(dt)[tokens]
        if kv is None:  # a training forward: under context parallelism its tokens are split
            x = split_length(x)
        inv_freq = jnp.asarray(inverse_frequencies(config))
        params = self.layers.arrays()
        # DSA's indexer weights are stacked over the layers that run it: each such layer reads its own
        indexing = {k: v for k, v in params.items() if k.startswith("index_")}
        params = {k: v for k, v in params.items() if not k.startswith("index_")}
        attention = {k: v for k, v in params.items() if base_name(k) not in _DENSE_MLP + _MOE_MLP}
        mlp = {"dense": {k: v for k, v in params.items() if base_name(k) in _DENSE_MLP},
               "moe": {k: v for k, v in params.items() if base_name(k) in _MOE_MLP}}
        forced = None if routing is None else jnp.moveaxis(routing.astype(jnp.int32), 2, 0)  # [Lm, B, T, k]
        if forced is not None:
            replay = jnp.ones((B, T), bool) if replay is None else jnp.broadcast_to(replay, (B, T)).astype(bool)

        # One scan per run of consecutive layers of one kind (dense or MoE), so each scan's
        # weights are its own stacked slices. The cache rides in the carry (not xs/ys) so XLA
        # updates it in place instead of restacking every layer's keys and values per decode step.
        sparse = config.dsa is not None and config.dsa.index_topk < key_count(allowed)
        # per layer: its row in the indexer's stack (-1: it reuses the previous full layer's top-k)
        index_row = jnp.asarray([config.indexer_layers.index(i) if i in config.indexer_layers else -1
                                 for i in range(config.num_layers)], jnp.int32)
        engine_indices = None if indices is None or not sparse else jnp.moveaxis(indices.astype(jnp.int32), 2, 0)
        if engine_indices is not None:  # [indexer layers, B, T, k]
            replay_indices = (jnp.zeros((B, T), bool) if replay_indices is None
                              else jnp.broadcast_to(replay_indices, (B, T)).astype(bool))
        no_choice = jnp.zeros((B, T, config.dsa.index_topk) if sparse else (0,), jnp.int32)

        def body(kind, carry, layer_in):
            x, kv, topk = carry
            if kv is None:  # the layer scan's carry keeps the split (the partitioner may not)
                x = split_length(x)
            p, m, f, layer = layer_in
            w = {name: value.astype(dt) for name, value in p.items()}
            adapting = lora.at(layer)
            # an indexer layer's own offsets, flips and (training the indexer) [Σ KL, queries]
            chosen = (no_choice, jnp.zeros((), jnp.float32), jnp.zeros((2,), jnp.float32))
            if config.mla is None:
                x, kv = _attention_block(config, w, x, positions, inv_freq, allowed, kv, layer, write_at, adapting,
                                         execution)
            elif not sparse and kv is None and index_loss is None:
                x = _latent_attention_block(config, w, None, x, positions, inv_freq, allowed, None, token_index,
                                            lora=adapting, execution=execution)[0]
            else:
                row = index_row[layer]

                def own(kv, topk):  # this layer runs its indexer
                    index_w = {name: value[row].astype(dt) for name, value in indexing.items()}
                    engine = None if engine_indices is None else engine_indices[jnp.maximum(row, 0)]
                    x_out, kv, used, offsets, flips, kl = _latent_attention_block(
                        config, w, index_w, x, positions, inv_freq, allowed, None, token_index, kv, layer, write_at,
                        adapting, engine, replay_indices, mask, index_loss, execution)
                    if used is None:  # every key attended: nothing chosen
                        return x_out, kv, topk, (no_choice, flips, kl)
                    return x_out, kv, used, (offsets, flips, kl)

                def shared(kv, topk):
                    x_out, kv = _latent_attention_block(config, w, None, x, positions, inv_freq, allowed,
                                                        topk if sparse and index_loss != "dense" else None,
                                                        token_index, kv, layer, write_at, adapting,
                                                        execution=execution)[:2]
                    return x_out, kv, topk, chosen

                x, kv, topk, chosen = jax.lax.cond(row >= 0, own, shared, kv, topk)
            h = rms_norm(x, w["mlp_norm"], config.rms_norm_eps)
            m = {name: value if name.startswith("router") else value.astype(dt) for name, value in m.items()}
            if kind == "dense":
                return (x + _dense_mlp(h, m, adapting), kv, topk), (None, chosen)
            out, info = _moe_mlp(config, h, m, f, replay, mask, adapting)
            return (x + out, kv, topk), (info, chosen)

        used, indexed = [], []
        topk = no_choice
        policy = execution.checkpoint_policy(T) if kv is None else None  # the training forward only
        if policy is not None:
            # a rolled scan: unrolled, XLA schedules every layer's recomputation as early as the
            # forward's and keeps the activations after all (0.6B step at 32k: 151 GiB, rolled 10)
            unroll = 1
        for kind, start, stop, first in _segments(config):
            xs = ({k: v[start:stop] for k, v in attention.items()},
                  {k: v[first:first + stop - start] for k, v in mlp[kind].items()},
                  None if forced is None or kind == "dense" else forced[first:first + stop - start],
                  jnp.arange(start, stop))
            layer_fn = functools.partial(body, kind)
            if policy is not None:  # the backward recomputes what the policy does not save
                layer_fn = jax.checkpoint(layer_fn, policy=policy, prevent_cse=False)  # a scan body: no CSE across steps
            (x, kv, topk), (info, chosen) = jax.lax.scan(layer_fn, (x, kv, topk), xs, unroll=unroll)
            if info is not None:
                used.append(info)
            indexed.append(chosen)
        if kv is None:  # and so do the hidden states the LM head reads
            x = split_length(x)
        x = rms_norm(x, self.final_norm[...], config.rms_norm_eps)
        index_info = {}
        rows = None if config.dsa is None else jnp.asarray(config.indexer_layers, jnp.int32)
        offsets, flips, kl = (jnp.concatenate(parts)[rows] if rows is not None else None for parts in zip(*indexed))
        if sparse and index_loss != "dense":  # each indexer layer's own choice [B, T, indexer layers, k], flips
            index_info = dict(index_offsets=jnp.moveaxis(offsets, 0, 2), index_flips=flips)
        if index_loss is not None:  # [indexer layers, 2]: Σ KL over the valid queries, their count
            index_info["index_kl"] = kl
        if not used:
            if not index_info:
                return x, kv, None
            empty = jnp.zeros((0,), jnp.float32)  # a DSA model without MoE layers: no router statistics
            return x, kv, RouterInfo(ids=jnp.zeros((B, T, 0, 0), jnp.int32), tokens_per_expert=empty[:, None],
                                     prob_per_expert=empty[:, None], z_loss=empty, flip_fraction=empty, **index_info)
        ids, f, P, z, flips = (jnp.concatenate(parts) for parts in zip(*used))
        return x, kv, RouterInfo(ids=jnp.moveaxis(ids, 0, 2), tokens_per_expert=f, prob_per_expert=P, z_loss=z,
                                 flip_fraction=flips, **index_info)


class Decoder(nnx.Module):
    """A causal language model: `logits = model(tokens)`, int32 [B, T] -> float32 [B, T, vocab]."""

    def __init__(self, config: ModelConfig, *, param_dtype: Any = jnp.float32, compute_dtype: Any = None,
                 rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.backbone = Backbone(config, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = _init(rngs, (config.hidden_size, config.vocab_size), param_dtype, ("embed", "vocab"))
        if config.lora is not None:
            add_adapters(self.backbone.layers, config.lora, rngs)

    @property
    def param_dtype(self) -> jnp.dtype:
        return self.backbone.embed[...].dtype

    def set_execution(self, execution: Execution) -> Decoder:
        """How this model's training forward computes from now on (attention, rematerialisation,
        log-probs in chunks; `models.execution`); it returns itself."""
        self.backbone.execution = execution
        return self

    def add_lora(self, lora: LoraConfig, rngs: nnx.Rngs) -> Decoder:
        """Add fresh adapters to this model in place (B zero: its function is unchanged) and return
        it; its config then carries `lora`. A model that has adapters keeps them (ValueError)."""
        if self.config.lora is not None:
            raise ValueError("the model already has LoRA adapters")
        self.config = self.backbone.config = dataclasses.replace(self.config, lora=lora)
        add_adapters(self.backbone.layers, lora, rngs)
        return self

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, unroll: int | bool = 1, routing: jax.Array | None = None,
                 replay: jax.Array | None = None, return_routing: bool = False, segment_ids: jax.Array | None = None,
                 adapter_ids: jax.Array | None = None, dropout_key: jax.Array | None = None,
                 indices: jax.Array | None = None, replay_indices: jax.Array | None = None,
                 index_loss: str | None = None, head: bool = True) -> jax.Array | tuple[jax.Array, RouterInfo | None]:
        """Logits [B, T, vocab]; with return_routing also the RouterInfo (see Backbone.forward).
        head=False: the final hidden states [B, T, hidden] instead (`logits` applies the head)."""
        hidden, info = self.backbone.forward(tokens, positions=positions, attention_mask=attention_mask, unroll=unroll,
                                             routing=routing, replay=replay, segment_ids=segment_ids,
                                             adapter_ids=adapter_ids, dropout_key=dropout_key, indices=indices,
                                             replay_indices=replay_indices, index_loss=index_loss)
        out = self.logits(hidden) if head else hidden
        return (out, info) if return_routing else out

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Output head on final hidden states [..., hidden] -> float32 logits [..., vocab]."""
        if self.config.tie_word_embeddings:
            head = self.backbone.embed[...].astype(hidden.dtype)
            out = jnp.einsum("...h,vh->...v", hidden, head)
        else:
            out = jnp.einsum("...h,hv->...v", hidden, self.lm_head[...].astype(hidden.dtype))
        return out.astype(jnp.float32)

    def decode(self, tokens: jax.Array, cache: KVCache, *, positions: jax.Array,
               attention_mask: jax.Array | None = None) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """Run T new tokens through the cache (a prompt's prefill, or the next token): the
        last position's logits [B, vocab], the cache, and the expert ids each token used
        [B, T, MoE layers, k] (None for a dense model): what an engine records for routing replay.
        A DSA model's indexer choices are `decode_choices`'."""
        logits, cache, info = self.decode_choices(tokens, cache, positions=positions, attention_mask=attention_mask)
        return logits, cache, None if info is None else info.ids

    def decode_choices(self, tokens: jax.Array, cache: KVCache, *, positions: jax.Array,
                       attention_mask: jax.Array | None = None) -> tuple[jax.Array, KVCache, RouterInfo | None]:
        """`decode`, with the whole RouterInfo: a DSA model's indexer choices too
        (index_offsets [B, T, indexer layers, k], what an engine records for index replay)."""
        hidden, cache, info = self.backbone.extend(tokens, cache, positions=positions, attention_mask=attention_mask)
        return self.logits(hidden[:, -1]), cache, info
