"""Rotary position embeddings in the Hugging Face "rotate half" layout, which Llama, Qwen2 and
Qwen3 checkpoints all use (llama.cpp's interleaved layout is undone when a GGUF is read)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """inv_freq[i] = theta^(-2i/d) for i < d/2, with the config's rope scaling applied.

    llama3 scaling (Llama 3.1): wavelengths longer than original_len/low_freq_factor are divided by
    `factor`, shorter than original_len/high_freq_factor are kept, and the band between is blended
    linearly in original_len/wavelength. Linear scaling divides every frequency by `factor`.
    """
    d = config.rotary_dim  # all of head_dim, or the part a partial rotary embedding turns
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    if s.kind == "linear":
        return (inv_freq / s.factor).astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [B, T, H, D], positions: [B, T] int. Returns x·cos + rotate_half(x)·sin, in x's dtype,
    on the first 2·len(inv_freq) dimensions (all of D, or a partial rotary embedding's part;
    the rest pass through).

    The angles are computed in float32 and cast to x's dtype before the product, as transformers
    does, so a bf16 model rotates exactly as its reference.
    """
    rotary = 2 * inv_freq.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq), x[..., rotary:]], axis=-1)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
