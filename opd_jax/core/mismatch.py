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


def _log_ratio(logp_old: jax.Array, logp_infer: jax.Array, on: jax.Array) -> jax.Array:
    """log k = logp_old − logp_infer where `on`, 0 elsewhere: selected, not multiplied, so a −inf
    or NaN engine log-prob off the mask (padding) never reaches a weight or a metric."""
    chex.assert_equal_shape([logp_old, logp_infer], custom_message="logp_old and logp_infer must share one shape")
    return jnp.where(on, logp_old.astype(jnp.float32) - logp_infer.astype(jnp.float32), 0.0)


@dataclasses.dataclass(frozen=True)
class MismatchCorrection:
    """Which correction, and its bounds. The one switch for every variant:

    - "none":       w = 1
    - "icepop":     w = k·1[lo ≤ k ≤ hi], lo = 1/hi by default (GLM-5: hi = β = 2)
    - "tis":        w = clip(k, lo, hi), lo = 0 by default
    - "mis":        w = k·1[lo ≤ k ≤ hi], lo = 0 by default (token masked IS)
    - "seq-tis":    w = clip(ρ, lo, hi) on every token of the sequence, ρ = Π_t k_t over its
                    response, lo = 0 by default
    - "seq-mis":    w = ρ·1[lo ≤ ρ ≤ hi], lo = 0 by default
    - "geo-reject": w = 1[lo ≤ ρ_geo ≤ hi], ρ_geo = exp(mean_t log k_t), lo = 1/hi by default
    - veto (any kind): the whole sequence gets w = 0 when some response token has k < veto
      (the 1e-4 veto of "When speed kills stability", Liu et al. 2025).

    Every kind but "none" uses [lo, hi]; setting lo for "none" is refused. The same band is the
    one `mismatch_metrics` reports tokens outside of.
    """

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    kind: CorrectionKind = "icepop"
    """Which correction: none, icepop (GLM-5), tis, mis, seq-tis, seq-mis or geo-reject."""
    hi: float = 2.0
    """Upper bound of the ratio band (IcePop's β; TIS's clip)."""
    lo: float | None = None
    """Lower bound; unset: 1/hi for icepop and geo-reject, 0 for the others (refused for none)."""
    veto: float | None = None
    """Zero the whole sequence when any token's ratio falls below this (e.g. 1e-4); unset: no veto."""

    def __post_init__(self):
        if self.kind not in CORRECTION_KINDS:
            raise ValueError(f"unknown mismatch correction {self.kind!r}; choose one of {', '.join(CORRECTION_KINDS)}")
        if self.kind == "none" and self.lo is not None:
            raise ValueError("mismatch correction 'none' has no bounds: leave lo unset")
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
    is 0 (whatever the log-probs hold there), stop-gradient. Sequence statistics are taken over
    each row's masked tokens in log space, so a long response's product of ratios never overflows."""
    chex.assert_rank([logp_old, logp_infer, mask], 2)
    chex.assert_equal_shape([logp_old, logp_infer, mask],
                            custom_message="mismatch_weights: logp_old, logp_infer and mask must share one [B, T] shape")
    on = mask > 0
    log_k = _log_ratio(logp_old, logp_infer, on)
    k = jnp.exp(log_k)
    lo, hi, kind = correction.lower, correction.hi, correction.kind
    log_lo, log_hi = jnp.log(jnp.float32(lo)), jnp.log(jnp.float32(hi))  # log 0 = −inf: no lower bound
    seq_log = jnp.sum(log_k, axis=1, keepdims=True)
    if kind == "none":
        w = jnp.ones(mask.shape, jnp.float32)
    elif kind == "icepop" or kind == "mis":
        w = jnp.where((k >= lo) & (k <= hi), k, 0.0)
    elif kind == "tis":
        w = jnp.clip(k, lo, hi)
    elif kind == "seq-tis":
        w = jnp.broadcast_to(jnp.exp(jnp.clip(seq_log, log_lo, log_hi)), mask.shape)
    elif kind == "seq-mis":
        inside = (seq_log >= log_lo) & (seq_log <= log_hi)
        w = jnp.broadcast_to(jnp.where(inside, jnp.exp(jnp.minimum(seq_log, log_hi)), 0.0), mask.shape)
    else:  # geo-reject
        geo = jnp.exp(seq_log / jnp.maximum(jnp.sum(on, axis=1, keepdims=True), 1))
        w = jnp.broadcast_to(((geo >= lo) & (geo <= hi)).astype(jnp.float32), mask.shape)
    if correction.veto is not None:
        vetoed = jnp.any((k < correction.veto) & on, axis=1, keepdims=True)
        w = jnp.where(vetoed, 0.0, w)
    return jax.lax.stop_gradient(jnp.where(on, w, 0.0))


def icepop_weights(logp_old: jax.Array, logp_infer: jax.Array, mask: jax.Array, hi: float = 2.0,
                   lo: float | None = None) -> jax.Array:
    """IcePop (Ring-1T; GLM-5): k = exp(logp_old − logp_infer); weight = k if lo ≤ k ≤ hi else 0,
    lo = 1/hi by default (GLM-5: hi = β = 2). Masked, not clipped; stop-gradient; [B, T].
    The step's own weights: `mismatch_weights` with kind "icepop"."""
    return mismatch_weights(logp_old, logp_infer, mask, MismatchCorrection("icepop", hi=hi, lo=lo))


def tis_weights(logp_old: jax.Array, logp_infer: jax.Array, mask: jax.Array, hi: float = 2.0,
                lo: float = 0.0) -> jax.Array:
    """Truncated importance sampling (Yao et al. 2025): weight = clip(k, lo, hi), stop-gradient;
    `mismatch_weights` with kind "tis"."""
    return mismatch_weights(logp_old, logp_infer, mask, MismatchCorrection("tis", hi=hi, lo=lo))


def mismatch_metrics(logp_old: jax.Array, logp_infer: jax.Array, mask: jax.Array,
                     correction: MismatchCorrection = MismatchCorrection()) -> dict[str, jax.Array]:
    """How far the engine is from the trainer on these tokens, masked means over the batch:
    k3 estimate of KL(engine ‖ trainer) = mean(k − 1 − log k), mean |logp_old − logp_infer|,
    max k, the fraction of tokens outside the correction's band [lo, hi] (GLM-5's IcePop:
    [1/2, 2]; for none and TIS lo = 0, so only k > hi counts) and outside the fixed [1/2, 2]
    whatever the correction (comparable across runs), the perplexity ratio engine / trainer =
    exp(mean log k), and quantiles of k (1 when no token is masked in). Values off the mask are never read."""
    chex.assert_equal_shape([logp_old, logp_infer, mask],
                            custom_message="mismatch_metrics: logp_old, logp_infer and mask must share one shape")
    on = mask > 0
    n = jnp.maximum(jnp.sum(on), 1).astype(jnp.float32)
    log_k = _log_ratio(logp_old, logp_infer, on)
    k = jnp.exp(log_k)
    lo, hi = correction.lower, correction.hi
    return jax.lax.stop_gradient({
        "mismatch_kl_k3": jnp.sum(k - 1.0 - log_k) / n,  # 0 off the mask: k = 1 there
        "mismatch_abs_logp_diff": jnp.sum(jnp.abs(log_k)) / n,
        "mismatch_ratio_max": jnp.max(jnp.where(on, k, 0.0)),
        "mismatch_outside_band_frac": jnp.sum(((k < lo) | (k > hi)) & on) / n,
        "mismatch_outside_2x_frac": jnp.sum(((k < 0.5) | (k > 2.0)) & on) / n,
        "mismatch_ppl_ratio": jnp.exp(jnp.sum(log_k) / n),
        **{f"mismatch_ratio_q{q:02d}": jnp.where(jnp.any(on), jnp.nanquantile(jnp.where(on, k, jnp.nan), q / 100), 1.0)
           for q in (1, 10, 50, 90, 99)},
    })
