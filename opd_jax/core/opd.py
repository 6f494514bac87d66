"""On-policy distillation (OPD) from domain teachers: the per-token signals. Pure.

The student samples y ~ π_s; a teacher π_t scores the same tokens. Sources: GLM-5 §3.5 (OPD
merges the RL experts; the advantage goes through the clipped / IcePop policy loss), Thinking
Machines' "On-Policy Distillation" (per-token reverse KL, sampled), Xiaomi MiMo's MOPD (plus a
task-reward advantage).
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp


def reverse_kl_advantage(logp_teacher: jax.Array, logp_student: jax.Array, mask: jax.Array) -> jax.Array:
    """Sampled-token reverse-KL advantage, per token:

        Â_t = sg[log π_t(y_t | y_<t) − log π_s(y_t | y_<t)] · m_t

    Its expectation under π_s is −KL(π_s ‖ π_t) at that position, so maximising Σ_t Â_t log π_s
    moves the student toward the teacher where it samples. Zero outside the mask. [B, T] each."""
    chex.assert_equal_shape([logp_teacher, logp_student, mask])
    advantage = logp_teacher.astype(jnp.float32) - logp_student.astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.where(mask.astype(bool), advantage, 0.0))


def opd_advantages(logp_teacher: jax.Array, logp_student: jax.Array, mask: jax.Array,
                   reward_advantages: jax.Array | None = None, alpha: float = 0.0) -> jax.Array:
    """Â_t = sg[log π_t − log π_s] + α · Â^ORM_t (MiMo MOPD); Â^ORM: any task-reward advantage
    [B, T] (e.g. `group_advantages` broadcast over the response). α = 0 is plain OPD."""
    advantage = reverse_kl_advantage(logp_teacher, logp_student, mask)
    if alpha:
        if reward_advantages is None:
            raise ValueError("alpha > 0 needs reward_advantages")
        chex.assert_equal_shape([advantage, reward_advantages])
        advantage = advantage + alpha * jnp.where(mask.astype(bool), jax.lax.stop_gradient(reward_advantages), 0.0)
    return advantage


Divergence = Literal["reverse_kl", "forward_kl", "jsd", "skew_forward_kl", "skew_reverse_kl"]
DIVERGENCES: tuple[str, ...] = Divergence.__args__  # type: ignore[attr-defined]

_FLOOR = -1e30  # a log-probability of exactly 0 probability (−inf) held finite: 0 · (−inf) would be NaN


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """KL(p ‖ q) = Σ_v p(v) (log p(v) − log q(v)) over the last axis; p(v) = 0 terms are 0."""
    log_p = jnp.maximum(log_p, _FLOOR)
    return jnp.sum(jnp.exp(log_p) * (log_p - jnp.maximum(log_q, _FLOOR)), axis=-1)


def _log_mix(log_p: jax.Array, log_q: jax.Array, weight: float) -> jax.Array:
    """log(w · p + (1 − w) · q), stably."""
    return jnp.logaddexp(jnp.log(weight) + log_p, jnp.log1p(-weight) + log_q)


def divergence(log_student: jax.Array, log_teacher: jax.Array, kind: Divergence = "reverse_kl", *,
               jsd_beta: float = 0.5, skew_alpha: float = 0.1) -> jax.Array:
    """A divergence between the student's distribution s and the teacher's t at every position,
    both given as normalised log-probabilities over the same support (the last axis):

        reverse_kl       KL(s ‖ t) = Σ_v s (log s − log t)        mode-seeking (GLM-5, Thinking Machines)
        forward_kl       KL(t ‖ s) = Σ_v t (log t − log s)        mass-covering (supervised KD)
        jsd              JSD(β) = β KL(t ‖ m) + (1 − β) KL(s ‖ m),  m = β t + (1 − β) s   (GKD, Agarwal
                         et al. 2024); JSD(β)/β → KL(t ‖ s) as β → 0, JSD(β)/(1 − β) → KL(s ‖ t)
                         as β → 1; bounded by H(β) = −β log β − (1 − β) log(1 − β) (log 2 at β = ½)
        skew_forward_kl  KL(t ‖ α s + (1 − α) t)                  (DistiLLM, Ko et al. 2024)
        skew_reverse_kl  KL(s ‖ α t + (1 − α) s)

    jsd_beta ∈ (0, 1), skew_alpha ∈ (0, 1]. The teacher is stop-gradient; differentiable in the
    student. [..., V] each → [...]."""
    chex.assert_equal_shape([log_student, log_teacher])
    log_s = log_student.astype(jnp.float32)
    log_t = jax.lax.stop_gradient(log_teacher.astype(jnp.float32))
    if kind == "reverse_kl":
        return _kl(log_s, log_t)
    if kind == "forward_kl":
        return _kl(log_t, log_s)
    if kind == "jsd":
        if not 0.0 < jsd_beta < 1.0:
            raise ValueError(f"jsd_beta must be in (0, 1) (its ends are forward_kl and reverse_kl), got {jsd_beta}")
        log_m = _log_mix(log_t, log_s, jsd_beta)
        return jsd_beta * _kl(log_t, log_m) + (1.0 - jsd_beta) * _kl(log_s, log_m)
    if kind in ("skew_forward_kl", "skew_reverse_kl"):
        if not 0.0 < skew_alpha <= 1.0:
            raise ValueError(f"skew_alpha must be in (0, 1], got {skew_alpha}")
        if kind == "skew_forward_kl":
            return _kl(log_t, _log_mix(log_s, log_t, skew_alpha) if skew_alpha < 1 else log_s)
        return _kl(log_s, _log_mix(log_t, log_s, skew_alpha) if skew_alpha < 1 else log_t)
    raise ValueError(f"unknown divergence {kind!r}; use one of {', '.join(DIVERGENCES)}")


def full_support(student_logits: jax.Array, teacher_logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log s, log t) over the whole vocabulary: s = softmax(student_logits); the teacher's
    log-probs (or logits) renormalised. [B, T, V] each."""
    chex.assert_equal_shape([student_logits, teacher_logprobs])
    return (jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1),
            jax.nn.log_softmax(teacher_logprobs.astype(jnp.float32), axis=-1))


def top_k_support(student_logits: jax.Array, teacher_top_logprobs: jax.Array, teacher_top_ids: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """(log s̃, log t̃) on the teacher's top-k support S, both distributions renormalised there:

        s̃ = π_s|S / π_s(S),  t̃ = π_t|S / π_t(S)

    (the tail outside S is dropped from both), for teachers that return only their top-k
    (a server). student_logits [B, T, V]; teacher_top_logprobs, teacher_top_ids [B, T, K] → [B, T, K] each."""
    chex.assert_equal_shape([teacher_top_logprobs, teacher_top_ids])
    chex.assert_equal_shape_prefix([student_logits, teacher_top_ids], 2)
    log_s = jnp.take_along_axis(jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1),
                                teacher_top_ids, axis=-1)
    return (jax.nn.log_softmax(log_s, axis=-1),
            jax.nn.log_softmax(teacher_top_logprobs.astype(jnp.float32), axis=-1))


def running_divergence(previous: jax.Array, observed: jax.Array, present: jax.Array, decay: float) -> jax.Array:
    """Each teacher's running divergence, an exponential moving average over the steps that had
    its rows:

        r_k ← decay · r_k + (1 − decay) · d_k   if teacher k had rows this step (present[k])
        r_k ← d_k                               on its first such step (r_k NaN)
        r_k unchanged                           otherwise

    previous, observed: float [K]; present: bool [K]; decay in [0, 1)."""
    chex.assert_equal_shape([previous, observed, present])
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    updated = jnp.where(jnp.isnan(previous), observed, decay * previous + (1.0 - decay) * observed)
    return jnp.where(present, updated, previous)


def balance_weights(running: jax.Array, floor: float) -> jax.Array:
    """Domain balancing: each teacher's weight in the distillation loss, larger where its domain's
    divergence stays high, so the easy domains do not dominate the gradient:

        d⁺_k = max(r_k, 0)   (the sampled estimate can dip below 0; an unseen teacher, r_k NaN,
                              counts as the mean of the seen ones)
        u_k  = max(d⁺_k / mean_j d⁺_j, floor)        (1 for all when every d⁺ is 0)
        w_k  = u_k / mean_j u_j                      (mean weight 1: the loss keeps its scale)

    running: float [K] (`running_divergence`); floor in (0, 1]: no domain's weight falls below
    floor / mean(u) however well it is learnt."""
    chex.assert_rank(running, 1)
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"floor must be in (0, 1], got {floor}")
    seen = ~jnp.isnan(running)
    d = jnp.maximum(jnp.where(seen, running, 0.0), 0.0)
    mean_seen = jnp.sum(d) / jnp.maximum(jnp.sum(seen), 1)
    d = jnp.where(seen, d, mean_seen)
    mean = jnp.mean(d)
    u = jnp.where(mean > 0, jnp.maximum(d / jnp.where(mean > 0, mean, 1.0), floor), 1.0)
    return u / jnp.mean(u)


def select_teacher(per_teacher: jax.Array, teacher_index: jax.Array) -> jax.Array:
    """Each row's own teacher's values: out[b, t] = per_teacher[teacher_index[b], b, t].

    per_teacher: [K, B, T] (K teachers' log-probs of the same tokens); teacher_index: int [B]."""
    chex.assert_rank([per_teacher, teacher_index], [3, 1])
    chex.assert_equal(per_teacher.shape[1], teacher_index.shape[0])
    return jnp.take_along_axis(per_teacher, teacher_index[None, :, None], axis=0)[0]
