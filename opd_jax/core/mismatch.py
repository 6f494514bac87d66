"""Train/inference mismatch corrections: per-token weights from trainer vs engine log-probs. Pure.

Every correction starts from the per-token ratio k_t = exp(logp_old_t − logp_infer_t) of the
trainer's θ_old probability to the one the rollout engine reported while sampling. The weights
are constants of the loss (stop-gradient) and multiply the clipped surrogate per token.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import chex
import jax
import jax.numpy as jnp

CorrectionKind = Literal["none", "icepop", "tis", "mis", "seq-tis", "seq-mis", "geo-reject"]
CORRECTION_KINDS: tuple[str, ...] = CorrectionKind.__args__  # type: ignore[attr-defined]


def _log_ratio(logp_old: jax.Array, logp_infer: jax.Array) -> jax.Array:
    chex.assert_equal_shape([logp_old, logp_infer], custom_message="logp_old and logp_infer must share one shape")
    return logp_old.astype(jnp.float32) - logp_infer.astype(jnp.float32)


def icepop_weights(logp_old: jax.Array, logp_infer: jax.Array, beta: float = 2.0,
                   alpha: float | None = None) -> jax.Array:
    """IcePop (Ring-1T; GLM-5): k = exp(logp_old − logp_infer); weight = k if α ≤ k ≤ β else 0.

    α defaults to 1/β (GLM-5: β = 2). Tokens outside the band are masked, not clipped. The weight
    is a constant of the loss (stop-gradient). logp_old, logp_infer: [B, T] -> [B, T].
    """
    alpha = 1.0 / beta if alpha is None else alpha
    k = jnp.exp(_log_ratio(logp_old, logp_infer))
    return jax.lax.stop_gradient(jnp.where((k >= alpha) & (k <= beta), k, 0.0))


def tis_weights(logp_old: jax.Array, logp_infer: jax.Array, hi: float = 2.0, lo: float = 0.0) -> jax.Array:
    """Truncated importance sampling (Yao et al. 2025): weight = clip(k, lo, hi), stop-gradient."""
    k = jnp.exp(_log_ratio(logp_old, logp_infer))
    return jax.lax.stop_gradient(jnp.clip(k, lo, hi))


@dataclasses.dataclass(frozen=True)
class MismatchCorrection:
    """Which correction, and its bounds. The one switch for every variant:

    - "none":       w = 1
    - "icepop":     w = k·1[lo ≤ k ≤ hi], lo = 1/hi by default (GLM-5: hi = β = 2)
    - "tis":        w = clip(k, lo, hi), lo = 0 by default
    - "mis":        w = k·1[lo ≤ k ≤ hi], lo = 0 by default (token masked IS)
    - "seq-tis":    w = min(ρ, hi) on every token of the sequence, ρ = Π_t k_t over its response
    - "seq-mis":    w = ρ·1[ρ ≤ hi]
    - "geo-reject": w = 1[lo ≤ ρ_geo ≤ hi], ρ_geo = exp(mean_t log k_t), lo = 1/hi by default
    - veto (any kind): the whole sequence gets w = 0 when some response token has k < veto
      (the 1e-4 veto of "When speed kills stability", Liu et al. 2025).
    """

    kind: CorrectionKind = "icepop"
    hi: float = 2.0
    lo: float | None = None
    veto: float | None = None

    def __post_init__(self):
        if self.kind not in CORRECTION_KINDS:
            raise ValueError(f"unknown mismatch correction {self.kind!r}; choose one of {', '.join(CORRECTION_KINDS)}")
        lo = self.lower
        if not (self.hi > 0 and 0 <= lo <= self.hi):
            raise ValueError(f"mismatch correction needs 0 <= lo <= hi and hi > 0, got lo={lo}, hi={self.hi}")
        if self.veto is not None and not 0 < self.veto < 1:
            raise ValueError(f"mismatch veto threshold must lie in (0, 1), got {self.veto}")

    @property
    def lower(self) -> float:
        if self.lo is not None:
            return self.lo
        return 1.0 / self.hi if self.kind in ("icepop", "geo-reject") else 0.0


def mismatch_weights(logp_old: jax.Array, logp_infer: jax.Array, mask: jax.Array,
                     correction: MismatchCorrection = MismatchCorrection()) -> jax.Array:
    """Per-token loss weights [B, T] for `correction` (see MismatchCorrection), zero where mask
    is 0, stop-gradient. Sequence statistics are taken over each row's masked tokens in log
    space, so a long response's product of ratios never overflows."""
    chex.assert_rank([logp_old, logp_infer, mask], 2)
    chex.assert_equal_shape([logp_old, logp_infer, mask],
                            custom_message="mismatch_weights: logp_old, logp_infer and mask must share one [B, T] shape")
    m = mask.astype(jnp.float32)
    log_k = _log_ratio(logp_old, logp_infer) * m
    k = jnp.exp(log_k)
    lo, hi, kind = correction.lower, correction.hi, correction.kind
    log_hi = jnp.log(jnp.float32(hi))
    seq_log = jnp.sum(log_k, axis=1, keepdims=True)
    if kind == "none":
        w = jnp.ones_like(m)
    elif kind == "icepop" or kind == "mis":
        w = jnp.where((k >= lo) & (k <= hi), k, 0.0)
    elif kind == "tis":
        w = jnp.clip(k, lo, hi)
    elif kind == "seq-tis":
        w = jnp.broadcast_to(jnp.exp(jnp.minimum(seq_log, log_hi)), m.shape)
    elif kind == "seq-mis":
        w = jnp.broadcast_to(jnp.where(seq_log <= log_hi, jnp.exp(jnp.minimum(seq_log, log_hi)), 0.0), m.shape)
    else:  # geo-reject
        geo = jnp.exp(seq_log / jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0))
        w = jnp.broadcast_to(((geo >= lo) & (geo <= hi)).astype(jnp.float32), m.shape)
    if correction.veto is not None:
        vetoed = jnp.any((k < correction.veto) & (m > 0), axis=1, keepdims=True)
        w = jnp.where(vetoed, 0.0, w)
    return jax.lax.stop_gradient(w * m)


def mismatch_metrics(logp_old: jax.Array, logp_infer: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """How far the engine is from the trainer on these tokens, masked means over the batch:
    k3 estimate of KL(engine ‖ trainer) = mean(k − 1 − log k), mean |logp_old − logp_infer|,
    max k, the fraction of tokens outside GLM-5's IcePop band [1/2, 2], the perplexity ratio
    engine / trainer = exp(mean log k), and quantiles of k (1 when no token is masked in)."""
    chex.assert_equal_shape([logp_old, logp_infer, mask],
                            custom_message="mismatch_metrics: logp_old, logp_infer and mask must share one shape")
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    log_k = _log_ratio(logp_old, logp_infer) * m
    k = jnp.exp(log_k)
    return jax.lax.stop_gradient({
        "mismatch_kl_k3": jnp.sum((k - 1.0 - log_k) * m) / n,
        "mismatch_abs_logp_diff": jnp.sum(jnp.abs(log_k)) / n,
        "mismatch_ratio_max": jnp.max(jnp.where(m > 0, k, 0.0)),
        "mismatch_outside_band_frac": jnp.sum(((k < 0.5) | (k > 2.0)) * m) / n,
        "mismatch_ppl_ratio": jnp.exp(jnp.sum(log_k) / n),
        **{f"mismatch_ratio_q{q:02d}": jnp.where(jnp.any(m > 0), jnp.nanquantile(jnp.where(m > 0, k, jnp.nan), q / 100), 1.0)
           for q in (1, 10, 50, 90, 99)},
    })
