"""PPO losses: the clipped policy surrogate and the clipped value loss. Pure.

Each loss returns (loss, metrics) with metrics["loss_sum"] and metrics["token_count"] beside the
reduced loss, so micro-batch gradient accumulation can reduce exactly as one big batch would.
Masks select (`where`), they never multiply: a NaN or −inf off the mask stays out of every sum.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import chex
import jax
import jax.numpy as jnp

from opd_jax.core.metrics import Maxed, Summed
from opd_jax.core.mismatch import MismatchCorrection
from opd_jax.core.registry import POLICY_LOSSES

Aggregation = Literal["token-mean", "seq-mean-token-mean"]


def check_surrogate(eps_low: float, eps_high: float, dual_clip: float | None, agg: str, kind: str = "ppo") -> None:
    """The clipped surrogate's knobs, as `policy_loss` needs them (ValueError naming the knob)."""
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    part = POLICY_LOSSES.get(kind)
    if dual_clip is not None and "dual-clip" not in part.needs:
        raise ValueError(f"dual_clip applies to the policy losses {', '.join(n for n in POLICY_LOSSES.names() if 'dual-clip' in POLICY_LOSSES.get(n).needs)}; "  # noqa: E501
                         f"{kind} clips otherwise")
    if agg not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"unknown loss_agg {agg!r}; use 'token-mean' or 'seq-mean-token-mean'")


@dataclasses.dataclass(frozen=True)
class SurrogateConfig:
    """The clipped, mismatch-weighted policy loss every RL step trains through (PPO, OPD): its kind
    (PPO's token ratio, GSPO's sequence ratio, CISPO's clipped stopped weight; `policy_loss`),
    clip range [1 − eps_low, 1 + eps_high] (DAPO's clip-higher), optional dual clip c > 1, the
    loss aggregation, the train/inference mismatch correction (IcePop β = 2 by default), and an
    entropy bonus: loss − entropy_coef · mean entropy of the policy on the response tokens."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    kind: str = "ppo"
    """The policy loss, by registered name or 'module:function' (gspo: set eps ~3e-4 / 4e-4, as its paper)."""
    eps_low: float = 0.2
    """Clip the ratio from below at 1 − eps_low."""
    eps_high: float = 0.28
    """Clip the ratio from above at 1 + eps_high (DAPO's clip-higher)."""
    dual_clip: float | None = None
    """Dual clip c > 1: for A < 0 the loss is at most −c·A; unset: off."""
    loss_agg: Aggregation = "token-mean"
    """token-mean over the batch (DAPO) or seq-mean-token-mean (GRPO paper)."""
    mismatch: MismatchCorrection = MismatchCorrection()
    """The train/inference mismatch correction that weights each token."""
    entropy_coef: float = 0.0
    """Subtract entropy_coef × the policy's mean entropy on response tokens from the loss."""

    def __post_init__(self):
        check_surrogate(self.eps_low, self.eps_high, self.dual_clip, self.loss_agg, self.kind)
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")


def loss_denominator(mask: jax.Array, agg: Aggregation) -> jax.Array:
    """What `agg` divides the summed loss by: the number of masked tokens (token-mean) or of rows
    with at least one masked token (seq-mean-token-mean). Computed once over a whole mini-batch
    and passed to each micro-batch's loss as `normalizer`, the micro-batch gradients add up to
    the mini-batch's gradient exactly."""
    m = mask.astype(jnp.float32)
    if agg == "token-mean":
        return jnp.sum(m)
    if agg == "seq-mean-token-mean":
        return jnp.sum((jnp.sum(m, axis=1) > 0).astype(jnp.float32))
    raise ValueError(f"unknown loss aggregation {agg!r}; use 'token-mean' or 'seq-mean-token-mean'")


def aggregate(per_token: jax.Array, mask: jax.Array, agg: Aggregation,
              normalizer: jax.Array | float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, sum, denominator) of a per-token loss [B, T] over mask.

        token-mean:          Σ_bt l·m / Σ_bt m                          (DAPO)
        seq-mean-token-mean: Σ_b [Σ_t l·m / Σ_t m] / #rows with tokens   (GRPO paper)

    `normalizer` replaces this batch's own denominator (see `loss_denominator`)."""
    m = mask.astype(jnp.float32)
    count = loss_denominator(m, agg)
    selected = jnp.where(m > 0, per_token, 0.0)
    if agg == "token-mean":
        total = jnp.sum(selected)
    else:
        row_count = jnp.sum(m, axis=1)
        total = jnp.sum(jnp.where(row_count > 0, jnp.sum(selected, axis=1) / jnp.maximum(row_count, 1.0), 0.0))
    denominator = count if normalizer is None else jnp.asarray(normalizer, jnp.float32)
    return total / jnp.maximum(denominator, 1.0), total, count


def policy_loss(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, mask: jax.Array, *,
                eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = None,
                weights: jax.Array | None = None, agg: Aggregation = "token-mean",
                normalizer: jax.Array | float | None = None, kind: str = "ppo"
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped policy surrogate, per token (sg: stop-gradient):

        ppo (asymmetric clip-higher as in DAPO):
            r = exp(logp − logp_old)
            l = −w · min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A)
            dual clip (Ye et al. 2020), for A < 0 only: l = min(l, −w·c·A)
        gspo (Zheng et al. 2025, its token form): the sequence's length-normalised ratio
            s_i = exp( Σ_t m·(logp − logp_old) / Σ_t m ),   r_t = sg(s_i) · exp(logp_t − sg(logp_t))
            and l as ppo with r_t (its value is s_i; with seq-mean-token-mean its gradient is GSPO's)
        cispo (MiniMax-M1 2025): every token keeps a gradient, its ratio clipped and stopped as a weight
            l = −w · sg(clip(r, 1 − eps_low, 1 + eps_high)) · A · logp

    aggregated over mask by `agg` (divided by `normalizer` when given, see `aggregate`). w: mismatch
    weights (IcePop / TIS), default 1. All [B, T].
    Metrics: clip fractions (low: r < 1−eps_low with A < 0; high: r > 1+eps_high with A > 0), k3
    approx KL of θ_old to θ, ratio mean/max, fraction of masked-in tokens with weight 0.
    """
    chex.assert_rank([logp, logp_old, advantages, mask], 2)
    chex.assert_equal_shape([logp, logp_old, advantages, mask],
                            custom_message="policy_loss: logp, logp_old, advantages and mask must share one [B, T] shape")
    m = mask.astype(jnp.float32)
    w = jnp.ones_like(m) if weights is None else jax.lax.stop_gradient(weights.astype(jnp.float32))
    A = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    check_surrogate(eps_low, eps_high, dual_clip, agg, kind)
    logp = logp.astype(jnp.float32)
    token_log_ratio = logp - jax.lax.stop_gradient(logp_old.astype(jnp.float32))
    unweighted, ratio = POLICY_LOSSES.get(kind).fn(logp, logp_old.astype(jnp.float32), A, m, eps_low, eps_high)
    per_token = w * unweighted
    if dual_clip is not None:
        per_token = jnp.where(A < 0, jnp.minimum(per_token, -w * dual_clip * A), per_token)
    loss, total, count = aggregate(per_token, m, agg, normalizer)
    n = jnp.maximum(jnp.sum(m), 1.0)
    masked_mean = lambda x: jnp.sum(jnp.where(m > 0, x, 0.0)) / n  # noqa: E731
    metrics = {
        "loss_sum": Summed(total), "token_count": Summed(count),
        "clip_frac_low": masked_mean(((ratio < 1.0 - eps_low) & (A < 0)).astype(jnp.float32)),
        "clip_frac_high": masked_mean(((ratio > 1.0 + eps_high) & (A > 0)).astype(jnp.float32)),
        "approx_kl_k3": masked_mean(jnp.exp(-token_log_ratio) - 1.0 + token_log_ratio),
        "ratio_mean": masked_mean(ratio),
        "ratio_max": Maxed(jnp.max(jnp.where(m > 0, ratio, -jnp.inf))),
        "weight_zero_frac": masked_mean((w == 0).astype(jnp.float32)),
    }
    return loss, jax.lax.stop_gradient(metrics)


@POLICY_LOSSES.register("ppo", needs=("dual-clip",))
def ppo_loss(logp, logp_old, advantages, mask, eps_low, eps_high):
    """PPO's clipped surrogate on the token ratio (DAPO's clip-higher)."""
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp_old))
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -jnp.minimum(ratio * advantages, clipped * advantages), ratio


@POLICY_LOSSES.register("gspo", needs=("dual-clip", "sequence"))
def gspo_loss(logp, logp_old, advantages, mask, eps_low, eps_high):
    """GSPO: PPO's clip on one length-normalised sequence ratio (its token form)."""
    log_ratio = logp - jax.lax.stop_gradient(logp_old)
    lengths = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
    log_seq = jnp.sum(jnp.where(mask > 0, log_ratio, 0.0), axis=1, keepdims=True) / lengths
    ratio = jnp.exp(jax.lax.stop_gradient(log_seq) + logp - jax.lax.stop_gradient(logp))
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -jnp.minimum(ratio * advantages, clipped * advantages), ratio


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp, logp_old, advantages, mask, eps_low, eps_high):
    """CISPO: REINFORCE weighted by the clipped, stopped token ratio."""
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp_old))
    clipped = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    return -clipped * advantages * jnp.where(mask > 0, logp, 0.0), ratio


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array,
               clip: float | None = 0.2, normalizer: jax.Array | float | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss, masked token-mean:

        l = 0.5 · max((V − R)², (clip(V, V_old − ε_v, V_old + ε_v) − R)²)     (clip=None: 0.5·(V − R)²)
    """
    chex.assert_rank([values, old_values, returns, mask], 2)
    chex.assert_equal_shape([values, old_values, returns, mask],
                            custom_message="value_loss: values, old_values, returns and mask must share one [B, T] shape")
    m = mask.astype(jnp.float32)
    v = values.astype(jnp.float32)
    R = jax.lax.stop_gradient(returns.astype(jnp.float32))
    unclipped = (v - R) ** 2
    if clip is None:
        per_token, clipped_frac = 0.5 * unclipped, jnp.zeros(())
    else:
        v_old = jax.lax.stop_gradient(old_values.astype(jnp.float32))
        v_clipped = v_old + jnp.clip(v - v_old, -clip, clip)
        clipped_sq = (v_clipped - R) ** 2
        per_token = 0.5 * jnp.maximum(unclipped, clipped_sq)
        clipped_frac = jnp.sum((clipped_sq > unclipped) & (m > 0)) / jnp.maximum(jnp.sum(m), 1.0)
    loss, total, count = aggregate(per_token, m, "token-mean", normalizer)
    return loss, jax.lax.stop_gradient({"loss_sum": Summed(total), "token_count": Summed(count),
                                        "value_clip_frac": clipped_frac})


KLKind = Literal["k1", "k2", "k3", "low-var"]


def kl_estimate(logp: jax.Array, logp_ref: jax.Array, kind: KLKind = "k3") -> jax.Array:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman, "Approximating KL"):

        x = logp − logp_ref
        k1 = x,   k2 = x²/2,   k3 = exp(−x) − 1 + x
        low-var = k3 with x clamped to [−20, 20] and the result to [−10, 10] (as verl's low_var_kl)
    """
    chex.assert_equal_shape([logp, logp_ref],
                            custom_message="kl_estimate: logp and logp_ref must share one shape")
    x = logp.astype(jnp.float32) - logp_ref.astype(jnp.float32)
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return jnp.exp(-x) - 1.0 + x
    if kind == "low-var":
        x = jnp.clip(x, -20.0, 20.0)
        return jnp.clip(jnp.exp(-x) - 1.0 + x, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1', 'k2', 'k3' or 'low-var'")
