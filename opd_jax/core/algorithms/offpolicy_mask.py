"""DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, §3.1 "Off-Policy Sequence
Masking"), a registered mismatch correction (`surrogate.mismatch.kind: offpolicy-mask`).

A sequence that the sampling engine made too improbable for the policy being trained, and that
the update would push down (A < 0), is left out of the loss:

    M_i = 0  if  A_i < 0  and  (1/|o_i|) Σ_t log(π_infer(o_t) / π_θ(o_t)) > δ,   else 1

π_infer: the engine's probability of each sampled token; π_θ: the policy being updated (inside
each update's loss, stop-gradient), so the statistic holds both the engine/trainer mismatch and
the staleness of later mini-batches and epochs. A_i: the sample's advantage (the mean over its
response tokens, the same on every token for the group baselines). Other sequences keep w = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.core.registry import MISMATCH_CORRECTIONS, CorrectionInputs


def offpolicy_sequence_mask(log_k: jax.Array, on: jax.Array, advantages: jax.Array, delta: float) -> jax.Array:
    """M [B, T] (1 or 0 per sequence, on every token) from log_k = log π_θ − log π_infer per token
    (0 off the mask `on`) and the advantages [B, T]: 0 for a sequence with mean advantage < 0 whose
    mean of −log_k over its response exceeds delta."""
    count = jnp.maximum(jnp.sum(on, axis=1), 1)
    divergence = -jnp.sum(jnp.where(on, log_k, 0.0), axis=1) / count
    advantage = jnp.sum(jnp.where(on, advantages, 0.0), axis=1) / count
    masked = (advantage < 0) & (divergence > delta)
    return jnp.broadcast_to(jnp.where(masked, 0.0, 1.0)[:, None], log_k.shape)


@MISMATCH_CORRECTIONS.register("offpolicy-mask", needs=("sequence", "current"))
def offpolicy_mask(log_k: jax.Array, on: jax.Array, correction, inputs: CorrectionInputs, *,
                   delta: float = 0.1) -> jax.Array:
    """DeepSeek-V3.2's off-policy sequence masking: drop negative-advantage sequences whose mean log(π_infer/π_θ) > delta."""  # noqa: E501
    if inputs.advantages is None:
        raise ValueError("offpolicy-mask needs the advantages: it weights inside the policy loss")
    return offpolicy_sequence_mask(log_k, on, inputs.advantages, delta)
