"""On-policy distillation (OPD) from domain teachers: the per-token signals. Pure.

The student samples y ~ π_s; a teacher π_t scores the same tokens. Sources: GLM-5 §3.5 (OPD
merges the RL experts; the advantage goes through the clipped / IcePop policy loss), Thinking
Machines' "On-Policy Distillation" (per-token reverse KL, sampled), Xiaomi MiMo's MOPD (plus a
task-reward advantage).
"""

from __future__ import annotations

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


def full_reverse_kl(student_logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
    """Full-vocabulary reverse KL at every position, differentiable in the student:

        KL_t = Σ_v π_s(v) · (log π_s(v) − log π_t(v)),  π = softmax(logits) over the vocabulary

    student_logits, teacher_logits: [B, T, V] → [B, T]. The teacher is stop-gradient."""
    chex.assert_equal_shape([student_logits, teacher_logits])
    log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    log_t = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1))
    return jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)


def top_k_reverse_kl(student_logits: jax.Array, teacher_top_logprobs: jax.Array, teacher_top_ids: jax.Array
                     ) -> jax.Array:
    """Reverse KL on the teacher's top-k support, both distributions renormalised over it:

        S = top-k ids of π_t,  p̃_s = π_s|S / π_s(S),  p̃_t = π_t|S / π_t(S)
        KL_t = Σ_{v∈S} p̃_s(v) · (log p̃_s(v) − log p̃_t(v))

    For teachers that return only their top-k logprobs (a server). student_logits [B, T, V];
    teacher_top_logprobs, teacher_top_ids [B, T, K] → [B, T]."""
    chex.assert_equal_shape([teacher_top_logprobs, teacher_top_ids])
    chex.assert_equal_shape_prefix([student_logits, teacher_top_ids], 2)
    log_s = jnp.take_along_axis(jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1),
                                teacher_top_ids, axis=-1)
    log_s = log_s - jax.nn.logsumexp(log_s, axis=-1, keepdims=True)
    log_t = jax.lax.stop_gradient(teacher_top_logprobs.astype(jnp.float32))
    log_t = log_t - jax.nn.logsumexp(log_t, axis=-1, keepdims=True)
    return jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)


def select_teacher(per_teacher: jax.Array, teacher_index: jax.Array) -> jax.Array:
    """Each row's own teacher's values: out[b, t] = per_teacher[teacher_index[b], b, t].

    per_teacher: [K, B, T] (K teachers' log-probs of the same tokens); teacher_index: int [B]."""
    chex.assert_rank([per_teacher, teacher_index], [3, 1])
    chex.assert_equal(per_teacher.shape[1], teacher_index.shape[0])
    return jnp.take_along_axis(per_teacher, teacher_index[None, :, None], axis=0)[0]
