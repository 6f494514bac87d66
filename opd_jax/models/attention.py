"""Softmax attention of a training forward, exact, in memory that grows with T, not T².

The keys a query may attend are given by O(T) vectors (`AttentionMask`), never by a [B, T, S]
matrix, and `blockwise_attention` computes

    out(t) = Σ_s softmax_s(q(t)·k(s)/√d  over the allowed s) · v(s)

`block_q` queries against `block_k` keys at a time with an online softmax (FlashAttention's
running maximum m and normaliser l):

    m' = max(m, max_s x_s),  l' = l·e^(m−m') + Σ_s e^(x_s−m'),  acc' = acc·e^(m−m') + Σ_s e^(x_s−m')·v(s)

and out = acc / l. Its backward is its own (a custom VJP, FlashAttention-2's): from the output O
and the log-normaliser L = m + log l it recomputes each block's P = e^(X − L) and forms

    dV = Pᵀ·dO,  dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)),  dQ = dS·K / √d,  dK = dSᵀ·Q / √d

so nothing of size T × S is ever held, forward or backward. Every block is computed, the causal
upper triangle too (skipping it by a lax.cond made the layer scan's gradient keep every block's
scores). A query that may attend no key
(padding) outputs 0 (the dense form outputs the mean of every value there; no real token reads
either). `dense_attention` is the reference, and what the engine's cache paths use.
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.models.context import over_keys
from opd_jax.models.masks import AttentionMask, allowed_matrix
from opd_jax.models.mla import MASKED

Implementation = Literal["auto", "dense", "blockwise"]
"""How a training forward attends: dense (the [B, T, S] scores; the reference), blockwise (O(T)
memory, `blockwise_attention`), or auto: blockwise where the sequence is longer than one block."""


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query softmax(q·kᵀ/√d + mask)·v. q: [B,T,n,d]; k: [B,S,kv,d]; v: [B,S,kv,e] (e may
    differ from d: MLA's absorbed form); allowed: [B,T,S]; output [B,T,n,e]."""
    B, T, n, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(B, T, kv, n // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(allowed[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, n, v.shape[-1])


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, implementation: Implementation = "auto",
              block: int = 512) -> jax.Array:
    """Attention of q [B, T, n, d] over k [B, S, kv, d], v [B, S, kv, e] where `mask` allows, as `implementation`
    says (auto: blockwise when T or S exceeds `block`). Under context parallelism (a mesh whose
    "length" axis has several devices) each device attends its share of the queries to every key
    (`opd_jax.models.context.over_keys`)."""
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array:
        if implementation == "dense" or (implementation == "auto" and max(q.shape[1], k.shape[1]) <= block):
            return dense_attention(q, k, v, mask.dense())
        return blockwise_attention(q, k, v, mask, block_q=block, block_k=block)
    return over_keys(attend, q, k, v, mask)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, *, block_q: int = 512,
                        block_k: int = 512) -> jax.Array:
    """dense_attention(q, k, v, mask.dense()) in O(T + S) memory, forward and backward (see the
    module docstring). q [B, T, n, d]; k [B, S, kv, d]; v [B, S, kv, e] (n a multiple of kv); output [B, T, n, e]
    in q's dtype. block_q, block_k: queries and keys per block (T and S are padded up to them)."""
    chex.assert_rank([q, k, v], 4)
    chex.assert_equal_shape_prefix([k, v], 3)
    B, T, n, d = q.shape
    S, kv = k.shape[1], k.shape[2]
    chex.assert_shape([mask.query_index], (B, T))
    chex.assert_shape([mask.key_index, mask.key_valid], (B, S))
    bq, bk = min(block_q, T), min(block_k, S)
    nq, nk = -(-T // bq), -(-S // bk)
    segments = mask.query_segment is not None
    zeros = lambda shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    blocked = (
        _blocks(q.reshape(B, T, kv, n // kv, d), nq, bq),                      # [nq, B, bq, kv, g, d]
        _blocks(k, nk, bk), _blocks(v, nk, bk),                                  # [nk, B, bk, kv, d]
        _blocks(mask.query_index, nq, bq),
        _blocks(mask.query_segment if segments else zeros((B, T)), nq, bq),
        _blocks(mask.key_index, nk, bk),
        _blocks(mask.key_valid, nk, bk),                                       # padding keys: False
        _blocks(mask.key_segment if segments else zeros((B, S)), nk, bk),
    )
    # Tied to the queries: inside a differentiated layer scan the mask alone is loop-invariant, and
    # JAX's partial evaluation would hoist its every block out of the loop, T x S booleans (measured)
    blocked = jax.lax.optimization_barrier(blocked)
    out = _flash(*blocked)                                                      # [nq, B, bq, kv, g, d]
    return jnp.moveaxis(out, 0, 1).reshape(B, nq * bq, n, v.shape[-1])[:, :T]


def _blocks(x: jax.Array, n: int, size: int) -> jax.Array:
    """x [B, L, ...] padded along L to n·size and split: [n, B, size, ...]."""
    pad = n * size - x.shape[1]
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], n, size, *x.shape[2:]), 1, 0)


def _scores(qb, kb, qi, qs, ki, kvalid, ks):
    """One block's scaled scores [B, kv, g, bq, bk] (float32) and where they are allowed."""
    d = qb.shape[-1]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * (d ** -0.5)
    return s, allowed_matrix(qi, ki, kvalid, qs, ks)[:, None, None]


def _forward(q, k, v, qi, qs, ki, kvalid, ks):
    """Per query block, a scan over the key blocks: out [nq, B, bq, kv, g, d] and the
    log-normaliser L [nq, B, kv, g, bq] (MASKED where a query may attend nothing)."""

    def query_block(args):
        qb, qi_b, qs_b = args
        B, bq, kvh, g, d = qb.shape

        # every block is computed, the fully masked ones too: a lax.cond skipping them made JAX keep
        # every block's scores when the attention sits in the layer scan's gradient (measured)
        def key_block(carry, kblock):
            kb, vb, ki_b, kv_b, ks_b = kblock
            m, l, acc = carry
            s, ok = _scores(qb, kb, qi_b, qs_b, ki_b, kv_b, ks_b)
            m_new = jnp.maximum(m, jnp.max(jnp.where(ok, s, MASKED), axis=-1))
            p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
            scale = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
            return (m_new, l * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv), None

        init = (jnp.full((B, kvh, g, bq), MASKED, jnp.float32), jnp.zeros((B, kvh, g, bq), jnp.float32),
                jnp.zeros((B, kvh, g, bq, v.shape[-1]), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(key_block, init, (k, v, ki, kvalid, ks))
        some = l > 0
        out = jnp.where(some[..., None], acc / jnp.where(some, l, 1.0)[..., None], 0.0)
        lse = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), MASKED)
        return jnp.moveaxis(out, 3, 1).astype(qb.dtype), lse                # [B, bq, kv, g, d]

    return jax.lax.map(query_block, (q, qi, qs))


@jax.custom_vjp
def _flash(q, k, v, qi, qs, ki, kvalid, ks):
    return _forward(q, k, v, qi, qs, ki, kvalid, ks)[0]


def _flash_fwd(q, k, v, qi, qs, ki, kvalid, ks):
    out, lse = _forward(q, k, v, qi, qs, ki, kvalid, ks)
    return out, (q, k, v, qi, qs, ki, kvalid, ks, out, lse)


def _flash_bwd(res, dout):
    q, k, v, qi, qs, ki, kvalid, ks, out, lse = res
    # D = rowsum(dO ∘ O) per query: [nq, B, kv, g, bq]
    D = jnp.moveaxis(jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 2, -1)

    def key_block(dq, kblock):
        kb, vb, ki_b, kv_b, ks_b = kblock

        def query_block(dkv, qblock):
            qb, dob, lse_b, D_b, qi_b, qs_b, dq_b = qblock
            dk, dv = dkv
            s, ok = _scores(qb, kb, qi_b, qs_b, ki_b, kv_b, ks_b)
            p = jnp.where(ok, jnp.exp(s - lse_b[..., None]), 0.0)              # [B, kv, g, bq, bk]
            do = dob.astype(jnp.float32)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p, do)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do, vb.astype(jnp.float32))
            ds = p * (dp - D_b[..., None]) * (qb.shape[-1] ** -0.5)
            dq_new = dq_b + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb.astype(jnp.float32))
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb.astype(jnp.float32))
            return (dk, dv), dq_new

        init = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
        (dk, dv), dq = jax.lax.scan(query_block, init, (q, dout, lse, D, qi, qs, dq))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), (k, v, ki, kvalid, ks))
    no_grad = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731  (integer and boolean inputs)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            no_grad(qi), no_grad(qs), no_grad(ki), no_grad(kvalid), no_grad(ks))


_flash.defvjp(_flash_fwd, _flash_bwd)
