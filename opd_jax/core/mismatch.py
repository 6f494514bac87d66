"""Train/inference mismatch corrections: per-token weights from trainer vs engine log-probs. Pure.

Every correction starts from the per-token ratio k_t = exp(logp_old_t − logp_infer_t) of the
trainer's θ_old probability to the one the rollout engine reported while sampling. The weights
are constants of the loss (stop-gradient) and multiply the clipped surrogate per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp

from opd_jax.core.registry import MISMATCH_CORRECTIONS, CorrectionInputs


def _log_ratio(logp_old: jax.Array, logp_infer: jax.Array, on: jax.Array) -> jax.Array:
    """log k = logp_old − logp_infer where `on`, 0 elsewhere: selected, not multiplied, so a −inf
    or NaN engine log-prob off the mask (padding) never reaches a weight or a metric."""
    chex.assert_equal_shape([logp_old, logp_infer], custom_message="logp_old and logp_infer must share one shape")
    return jnp.where(on, logp_old.astype(jnp.float32) - logp_infer.astype(jnp.float32), 0.0)


# --- the registered corrections (`surrogate.mismatch.kind`): fn(log_k, on, correction, inputs, **params)

@MISMATCH_CORRECTIONS.register("none")
def no_correction(log_k, on, correction, inputs):
    """w = 1."""
    return jnp.ones(log_k.shape, jnp.float32)


@MISMATCH_CORRECTIONS.register("icepop", needs=("band", "symmetric"))
def icepop(log_k, on, correction, inputs):
    """IcePop (GLM-5): w = k·1[lo ≤ k ≤ hi], lo = 1/hi by default."""
    k = jnp.exp(log_k)
    return jnp.where((k >= correction.lower) & (k <= correction.hi), k, 0.0)


@MISMATCH_CORRECTIONS.register("tis", needs=("band",))
def tis(log_k, on, correction, inputs):
    """Token truncated IS: w = clip(k, lo, hi), lo = 0 by default."""
    return jnp.clip(jnp.exp(log_k), correction.lower, correction.hi)


@MISMATCH_CORRECTIONS.register("mis", needs=("band",))
def mis(log_k, on, correction, inputs):
    """Token masked IS: w = k·1[lo ≤ k ≤ hi], lo = 0 by default."""
    return icepop(log_k, on, correction, inputs)


def _band(correction: MismatchCorrection) -> tuple[jax.Array, jax.Array]:
    return jnp.log(jnp.float32(correction.lower)), jnp.log(jnp.float32(correction.hi))  # log 0 = −inf: no bound


@MISMATCH_CORRECTIONS.register("seq-tis", needs=("band", "sequence"))
def seq_tis(log_k, on, correction, inputs):
    """Sequence truncated IS: w = clip(ρ, lo, hi) on every token, ρ = Π_t k_t."""
    log_lo, log_hi = _band(correction)
    seq_log = jnp.sum(log_k, axis=1, keepdims=True)
    return jnp.broadcast_to(jnp.exp(jnp.clip(seq_log, log_lo, log_hi)), log_k.shape)


@MISMATCH_CORRECTIONS.register("seq-mis", needs=("band", "sequence"))
def seq_mis(log_k, on, correction, inputs):
    """Sequence masked IS: w = ρ·1[lo ≤ ρ ≤ hi] on every token."""
    log_lo, log_hi = _band(correction)
    seq_log = jnp.sum(log_k, axis=1, keepdims=True)
    inside = (seq_log >= log_lo) & (seq_log <= log_hi)
    return jnp.broadcast_to(jnp.where(inside, jnp.exp(jnp.minimum(seq_log, log_hi)), 0.0), log_k.shape)


@MISMATCH_CORRECTIONS.register("geo-reject", needs=("band", "symmetric", "sequence"))
def geo_reject(log_k, on, correction, inputs):
    """Geometric-mean rejection: w = 1[lo ≤ exp(mean_t log k_t) ≤ hi], lo = 1/hi by default."""
    geo = jnp.exp(jnp.sum(log_k, axis=1, keepdims=True) / jnp.maximum(jnp.sum(on, axis=1, keepdims=True), 1))
    return jnp.broadcast_to(((geo >= correction.lower) & (geo <= correction.hi)).astype(jnp.float32), log_k.shape)


@dataclasses.dataclass(frozen=True)
class MismatchCorrection:
    """Which correction (a registered name, see `MISMATCH_CORRECTIONS`, or 'module:function'), its
    bounds and its own parameters. The one switch for every variant:

    - "none":       w = 1
    - "icepop":     w = k·1[lo ≤ k ≤ hi], lo = 1/hi by default (GLM-5: hi = β = 2)
    - "tis":        w = clip(k, lo, hi), lo = 0 by default
    - "mis":        w = k·1[lo ≤ k ≤ hi], lo = 0 by default (token masked IS)
    - "seq-tis":    w = clip(ρ, lo, hi) on every token of the sequence, ρ = Π_t k_t over its
                    response, lo = 0 by default
    - "seq-mis":    w = ρ·1[lo ≤ ρ ≤ hi], lo = 0 by default
    - "geo-reject": w = 1[lo ≤ ρ_geo ≤ hi], ρ_geo = exp(mean_t log k_t), lo = 1/hi by default
    - "offpolicy-mask" (core/algorithms/offpolicy_mask.py): DeepSeek-V3.2's off-policy sequence
      masking, params {delta}
    - veto (any kind): the whole sequence gets w = 0 when some response token has k < veto
      (the 1e-4 veto of "When speed kills stability", Liu et al. 2025).

    Every kind that needs a band uses [lo, hi]; setting lo for one that does not is refused. The
    same band is the one `mismatch_metrics` reports tokens outside of.
    """

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    kind: str = "icepop"
    """The correction, by registered name or 'module:function' (icepop: GLM-5's)."""
    hi: float = 2.0
    """Upper bound of the ratio band (IcePop's β; TIS's clip)."""
    lo: float | None = None
    """Lower bound; unset: 1/hi for icepop and geo-reject, 0 for the others (refused for none)."""
    veto: float | None = None
    """Zero the whole sequence when any token's ratio falls below this (e.g. 1e-4); unset: no veto."""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The correction's own parameters (offpolicy-mask: {delta: 0.1}); keyword arguments of its function."""

    def __post_init__(self):
        part = MISMATCH_CORRECTIONS.get(self.kind)
        part.check_params(self.params, fixed=4)
        if "band" not in part.needs and self.lo is not None:
            raise ValueError(f"mismatch correction {self.kind!r} has no lower bound: leave lo unset")
        lo = self.lower
        if not (self.hi > 0 and 0 <= lo <= self.hi):
            raise ValueError(f"mismatch correction needs 0 <= lo <= hi and hi > 0, got lo={lo}, hi={self.hi}")
        if self.veto is not None and not 0 < self.veto < 1:
            raise ValueError(f"mismatch veto threshold must lie in (0, 1), got {self.veto}")

    def __hash__(self) -> int:  # params is a dict; a correction is compared by value
        return hash((self.kind, self.hi, self.lo, self.veto, tuple(sorted(self.params.items()))))

    @property
    def part(self):
        return MISMATCH_CORRECTIONS.get(self.kind)

    @property
    def lower(self) -> float:
        if self.lo is not None:
            return self.lo
        return 1.0 / self.hi if "symmetric" in self.part.needs else 0.0

    @property
    def needs_current_policy(self) -> bool:
        """Whether the weights are recomputed inside the loss from the policy being updated."""
        return "current" in self.part.needs


def correction_weights(log_k: jax.Array, mask: jax.Array, correction: MismatchCorrection,
                       inputs: CorrectionInputs = CorrectionInputs()) -> jax.Array:
    """Per-token weights [B, T] of `correction` from the log-ratio log_k of trainer to engine
    (0 off the mask), the veto applied; zero off the mask, stop-gradient."""
    on = mask > 0
    w = correction.part.fn(log_k, on, correction, inputs, **correction.params)
    if correction.veto is not None:
        vetoed = jnp.any((jnp.exp(log_k) < correction.veto) & on, axis=1, keepdims=True)
        w = jnp.where(vetoed, 0.0, w)
    return jax.lax.stop_gradient(jnp.where(on, w, 0.0))


def mismatch_weights(logp_old: jax.Array, logp_infer: jax.Array, mask: jax.Array,
                     correction: MismatchCorrection = MismatchCorrection(),
                     inputs: CorrectionInputs = CorrectionInputs()) -> jax.Array:
    """Per-token loss weights [B, T] for `correction` (see MismatchCorrection) from θ_old's and the
    engine's log-probs, zero where mask is 0 (whatever the log-probs hold there), stop-gradient.
    Sequence statistics are taken over each row's masked tokens in log space, so a long
    response's product of ratios never overflows. A correction that needs the current policy
    gets its weights in the loss (`current_policy_weights`); here they are 1 (veto applied)."""
    chex.assert_rank([logp_old, logp_infer, mask], 2)
    chex.assert_equal_shape([logp_old, logp_infer, mask],
                            custom_message="mismatch_weights: logp_old, logp_infer and mask must share one [B, T] shape")
    log_k = _log_ratio(logp_old, logp_infer, mask > 0)
    if correction.needs_current_policy:
        return correction_weights(log_k, mask, MismatchCorrection("none", veto=correction.veto))
    return correction_weights(log_k, mask, correction, inputs)


def current_policy_weights(weights: jax.Array, logp: jax.Array, logp_infer: jax.Array, mask: jax.Array,
                           correction: MismatchCorrection, advantages: jax.Array) -> jax.Array:
    """The weights inside the loss: `weights` times, for a correction that needs the current
    policy, its weights from the log-ratio of the policy being updated (logp, stop-gradient) to
    the engine; `weights` unchanged otherwise."""
    if not correction.needs_current_policy:
        return weights
    log_k = _log_ratio(jax.lax.stop_gradient(logp), logp_infer, mask > 0)
    return weights * correction_weights(log_k, mask, correction, CorrectionInputs(advantages=advantages))


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
