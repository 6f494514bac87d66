"""The OPD merge step: the student trained toward each prompt's own domain teacher, one pure
function of (state, batch), jitted and sharded by its caller like the PPO step.

    score the student:  batch.rollout.logp_old = θ_old log-probs (`policy_logprobs`)
    score the teachers: `teacher_scores` per teacher on its own rows (the shell routes them)
    opd_step(state, batch) -> (state, metrics)

Losses (`OPDConfig.loss`):
- "sampled" (GLM-5 §3.5, Thinking Machines): Â_t = sg[log π_t(y_t) − log π_old(y_t)] through the
  clipped surrogate with the mismatch weights (IcePop by default), plus α·Â^ORM (MiMo MOPD) when
  reward_alpha > 0, Â^ORM the group-baseline advantage of the task reward.
- "full": a divergence (`OPDConfig.divergence`: reverse KL Σ_v π_s log(π_s/π_t) by default,
  forward KL, GKD's JSD(β), skew KL; see `opd_jax.core.opd.divergence`) over the whole
  vocabulary at each response position, minimised directly (teachers must be local: the step
  needs the teacher's whole distribution). The caller may give each teacher its own divergence.
- "top_k": the same on the teacher's top-k tokens, both distributions renormalised there.
For "full" and "top_k" each position's divergence is multiplied by the same mismatch weight, and
α > 0 adds α × the clipped surrogate of Â^ORM. surrogate.entropy_coef > 0 subtracts coef · the
student's mean entropy on the response tokens from the loss.

`update.epochs` × `update.minibatches` updates, gradients summed over `update.microbatches`,
updates with non-finite gradients skipped, exactly as in `ppo_step` (shared machinery in
`opd_jax.core.update`). group_size, num_teachers and temperature are facts of the run, passed by
the caller, not knobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import chex
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.core.advantages import group_advantages
from opd_jax.core.batch import RolloutBatch
from opd_jax.core.distributions import picked_and_entropy
from opd_jax.core.forward import (
    RoutingReplay,
    policy_logprobs,
    sequence_logprobs,
    sequence_positions,
    training_key,
)
from opd_jax.core.losses import SurrogateConfig, aggregate, loss_denominator, policy_loss
from opd_jax.core.metrics import prefixed
from opd_jax.core.mismatch import current_policy_weights, mismatch_metrics, mismatch_weights
from opd_jax.core.opd import DIVERGENCES, Divergence, divergence, full_support, reverse_kl_advantage, top_k_support
from opd_jax.core.optim import loss_scale_of
from opd_jax.core.state import PolicyState
from opd_jax.core.update import (
    UpdateConfig,
    accumulate_grads,
    apply_update,
    batch_statistics,
    map_rows,
    run_updates,
    summed_loss,
)

PER_TEACHER_KL = "opd/reverse_kl_per_teacher"  # the metric: [num_teachers], each teacher's sampled reverse KL
DistillLoss = Literal["sampled", "full", "top_k"]
DISTILL_LOSSES: tuple[str, ...] = DistillLoss.__args__  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class OPDConfig:
    """Every knob of the OPD step: the distillation loss, the teacher's top-k for loss "top_k",
    MOPD's reward weight α (its group baseline optionally divided by the std), and the same
    `surrogate` and `update` sections as the PPO step (reverse KL is mode-seeking, and a student
    that turns confident where it is wrong gets almost no gradient from it: surrogate.entropy_coef
    counters that, see BENCHMARKS.md)."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    loss: DistillLoss = "sampled"
    """sampled: the sampled-token reverse KL as advantage (GLM-5); full / top_k: `divergence` on the vocabulary / top-k."""
    divergence: Divergence = "reverse_kl"
    """For loss full / top_k, what each position minimises: reverse_kl (mode-seeking), forward_kl
    (mass-covering), jsd (GKD's JSD(β), between the two), skew_forward_kl / skew_reverse_kl."""
    jsd_beta: float = 0.5
    """JSD(β)'s β in (0, 1): the teacher's weight in the mixture (→ 0: forward KL, → 1: reverse KL, scaled)."""
    skew_alpha: float = 0.1
    """Skew KL's α in (0, 1]: the other distribution's weight in the mixture (1: plain KL)."""
    top_k: int = 32
    """Teacher tokens per position for loss top_k."""
    reward_alpha: float = 0.0
    """MOPD: add reward_alpha × the task reward's group-baseline advantage (0: off)."""
    grpo_normalize_std: bool = True
    """Divide the reward advantage by the group's std."""
    surrogate: SurrogateConfig = SurrogateConfig()
    """The clipped, mismatch-weighted policy loss (shared with PPO)."""
    update: UpdateConfig = UpdateConfig()
    """Epochs, mini-batches and micro-batches of each step (shared with PPO)."""
    routing_replay: RoutingReplay = "none"
    """MoE student: r3 scores θ_old and trains with the engine's experts for every token it routed (as PPO's)."""
    index_replay: bool = False
    """DSA student (GLM-5): score θ_old and train attending the keys the engine's indexers chose (as PPO's)."""

    def __post_init__(self):
        if self.loss not in DISTILL_LOSSES:
            raise ValueError(f"unknown OPD loss {self.loss!r}; use one of {', '.join(DISTILL_LOSSES)}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"unknown divergence {self.divergence!r}; use one of {', '.join(DIVERGENCES)}")
        if self.loss == "sampled" and self.divergence != "reverse_kl":
            raise ValueError(f"divergence {self.divergence!r} needs the teacher's distribution: use loss 'full' or "
                             f"'top_k' (loss 'sampled' estimates the reverse KL from the sampled tokens)")
        if not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"jsd_beta must be in (0, 1) (its ends are forward_kl and reverse_kl), got {self.jsd_beta}")
        if not 0.0 < self.skew_alpha <= 1.0:
            raise ValueError(f"skew_alpha must be in (0, 1], got {self.skew_alpha}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.reward_alpha < 0:
            raise ValueError(f"reward_alpha must be >= 0, got {self.reward_alpha}")

    def check_batch_size(self, batch_size: int, group_size: int = 1) -> None:
        self.update.check_batch_size(batch_size, group_size if self.reward_alpha > 0 else None)


@flax.struct.dataclass
class DistillBatch:
    """The student's rollouts and what their teachers said of them. Per-token arrays are aligned
    with rollout.tokens, as in RolloutBatch: logp_teacher[b, t] = log π_teacher(tokens[b, t] |
    tokens[b, :t]); teacher_logprobs[b, t] is the teacher's distribution over that same token
    (top-k of it with teacher_ids, or the whole vocabulary when teacher_ids is None).

    rollout: with logp_old filled (the student's θ_old at the sampling temperature);
    teacher_index: int32 [B], the teacher of each row (its domain's); logp_teacher: [B, T];
    teacher_logprobs, teacher_ids: [B, T, K] (loss "top_k") or teacher_logprobs [B, T, V] ("full");
    row_weights: [B], each row's weight in the distillation term (domain balancing, see
    `balance_weights`; None: 1), not in the reward term;
    off_policy: [B], 1 where the row was not sampled by the student (its teacher's sample, GKD's
    fixed-dataset rows; None: every row the student's): the divergence is minimised on the given
    prefixes with weight 1 (no importance correction applies) and the row has no reward term."""

    rollout: RolloutBatch
    teacher_index: jax.Array
    logp_teacher: jax.Array
    teacher_logprobs: jax.Array | None = None
    teacher_ids: jax.Array | None = None
    row_weights: jax.Array | None = None
    off_policy: jax.Array | None = None


# --- forward passes -------------------------------------------------------------------------

def score_student(state: PolicyState, batch: RolloutBatch, *, temperature: float = 1.0,
                  microbatches: int = 1, routing_replay: bool = False, index_replay: bool = False) -> RolloutBatch:
    """The batch with logp_old filled in: the student's θ_old = state.params (see policy_logprobs);
    routing_replay: a MoE student scores with the engine's routing (batch.routing; R3);
    index_replay: a DSA student with the engine's chosen keys (batch.indices)."""
    return batch.replace(logp_old=policy_logprobs(state.graphdef, state.params, batch, temperature=temperature,
                                                  microbatches=microbatches, replay=routing_replay,
                                                  index_replay=index_replay))


def teacher_scores(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *, loss: DistillLoss,
                   top_k: int = 32, temperature: float = 1.0, microbatches: int = 1,
                   adapter_ids: jax.Array | None = None) -> dict[str, jax.Array]:
    """What one teacher says of the rows in `batch`, zero off the response mask:

        logp_teacher[b, t]      = log π_t(tokens[b, t] | tokens[b, :t])            always
        teacher_logprobs[b, t]  = log π_t(· | tokens[b, :t]) over the vocabulary    loss "full"
        (teacher_logprobs, teacher_ids)[b, t] = its top_k entries                   loss "top_k"

    π_t = softmax(teacher logits / temperature). Keys are DistillBatch's field names. A teacher
    whose adapters are a bank (`models.lora.bank`: LoRA teachers on one base) scores row b with
    adapter adapter_ids[b]: many teachers in one call."""
    def at(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
        if loss == "sampled":
            return (picked_and_entropy(logits, targets, with_entropy=False)[0],)
        dist = jax.nn.log_softmax(logits, axis=-1)  # the sampled token's log-prob read from it, not normalised again
        logp = jnp.take_along_axis(dist, targets[..., None], axis=-1)[..., 0]
        return (logp, dist) if loss == "full" else (logp, *jax.lax.top_k(dist, top_k))

    def one(rows: tuple[RolloutBatch, jax.Array | None]) -> dict[str, jax.Array]:
        b, ids = rows
        on = b.response_mask > 0
        # through the LM head in chunks of positions: no [B, T, V] of logits (the full loss's
        # distributions are [B, T, V] themselves)
        scores = sequence_positions(graphdef, params, b, at, temperature=temperature, adapter_ids=ids)
        names = ("logp_teacher", "teacher_logprobs", "teacher_ids")
        return {name: jnp.where(on.reshape(*on.shape, *(1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))
                for name, x in zip(names, scores)}
    return map_rows(one, (batch, adapter_ids), microbatches)


# --- the step -------------------------------------------------------------------------------

@flax.struct.dataclass
class _OPDTargets:
    batch: DistillBatch
    mask: jax.Array
    weights: jax.Array
    advantages: jax.Array  # "sampled": distillation + α·reward advantage; else α·reward advantage


def _check(batch: DistillBatch, config: OPDConfig, group_size: int) -> None:
    rollout = batch.rollout
    if rollout.logp_old is None:
        raise ValueError("opd_step needs batch.rollout.logp_old: score the student with policy_logprobs first")
    chex.assert_equal_shape([rollout.tokens, batch.logp_teacher],
                            custom_message="opd_step: logp_teacher must be [B, T] like the tokens")
    chex.assert_shape(batch.teacher_index, rollout.tokens.shape[:1],
                      custom_message="opd_step: teacher_index must hold one teacher per row")
    if batch.row_weights is not None:
        chex.assert_shape(batch.row_weights, rollout.tokens.shape[:1],
                          custom_message="opd_step: row_weights must hold one weight per row")
    if batch.off_policy is not None:
        chex.assert_shape(batch.off_policy, rollout.tokens.shape[:1],
                          custom_message="opd_step: off_policy must hold one flag per row")
        if config.loss == "sampled":
            raise ValueError("off-policy rows need loss 'full' or 'top_k' (the sampled loss is an on-policy estimate)")
    if config.loss != "sampled":
        if batch.teacher_logprobs is None:
            raise ValueError(f"loss {config.loss!r} needs batch.teacher_logprobs (local teachers' distributions)")
        chex.assert_equal_shape_prefix([rollout.tokens, batch.teacher_logprobs], 2)
    if config.loss == "top_k" and batch.teacher_ids is None:
        raise ValueError("loss 'top_k' needs batch.teacher_ids")
    config.check_batch_size(rollout.tokens.shape[0], group_size)


def _targets(batch: DistillBatch, config: OPDConfig, group_size: int, num_teachers: int
             ) -> tuple[_OPDTargets, dict[str, jax.Array]]:
    rollout = batch.rollout
    m = rollout.response_mask.astype(jnp.float32)
    correction = config.surrogate.mismatch
    weights = mismatch_weights(rollout.logp_old, rollout.logp_infer, m, correction)
    on_policy = 1.0
    if batch.off_policy is not None:  # a teacher's sample: no behaviour policy of the student's to correct for
        off = batch.off_policy[:, None] > 0
        weights, on_policy = jnp.where(off, m, weights), jnp.where(off, 0.0, 1.0)
    distill = reverse_kl_advantage(batch.logp_teacher, rollout.logp_old, m)  # −(sampled reverse KL) per token
    reward = jnp.zeros_like(m)
    if config.reward_alpha > 0:
        group = group_advantages(rollout.rewards, group_size, config.grpo_normalize_std)
        reward = jnp.where(m > 0, group[:, None], 0.0) * on_policy
    balance = 1.0 if batch.row_weights is None else batch.row_weights[:, None].astype(jnp.float32)
    advantages = config.reward_alpha * reward + (balance * distill if config.loss == "sampled" else 0.0)
    # the sampled reverse KL, log π_old − log π_teacher, over the student's own rows' tokens (on a
    # teacher's sample it would estimate minus the forward KL): overall and per teacher
    student_tokens = m * on_policy
    n = jnp.maximum(jnp.sum(student_tokens), 1.0)
    onehot = jax.nn.one_hot(batch.teacher_index, num_teachers, dtype=jnp.float32)  # [B, K]
    per_teacher_kl = (onehot.T @ -jnp.sum(distill * on_policy, axis=1)) / jnp.maximum(onehot.T @ jnp.sum(student_tokens, 1), 1.0)
    token_inputs = [rollout.logp_infer, rollout.logp_old, batch.logp_teacher]
    stats = {
        **batch_statistics(rollout.rewards, m, rollout.logp_old, rollout.logp_infer, token_inputs, correction),
        "opd/reverse_kl": -jnp.sum(distill * on_policy) / n,
        PER_TEACHER_KL: per_teacher_kl,  # [num_teachers]
    }
    if batch.off_policy is not None:  # the engine/trainer mismatch exists only on the student's own samples
        stats.update(mismatch_metrics(rollout.logp_old, rollout.logp_infer, student_tokens, correction))
        stats["opd/off_policy_rows"] = jnp.sum(batch.off_policy.astype(jnp.float32))
    return _OPDTargets(batch=batch, mask=m, weights=weights, advantages=advantages), stats


def _position_divergence(student_logits: jax.Array, teacher_logprobs: jax.Array, teacher_ids: jax.Array | None,
                         which: jax.Array, config: OPDConfig, kinds: tuple[str, ...]) -> jax.Array:
    """Each position's divergence [B, c] between the student's distribution (its logits [B, c, V]
    for that position's token) and its row's teacher's (teacher_logprobs [B, c, V], or its top k
    with teacher_ids [B, c, K]), of the kind kinds[which] ([B, c])."""
    if teacher_ids is None:
        log_s, log_t = full_support(student_logits, teacher_logprobs)
    else:
        log_s, log_t = top_k_support(student_logits, teacher_logprobs, teacher_ids)
    per_kind = [divergence(log_s, log_t, kind, jsd_beta=config.jsd_beta, skew_alpha=config.skew_alpha)  # type: ignore[arg-type]
                for kind in kinds]
    if len(kinds) == 1:
        return per_kind[0]
    return jnp.take_along_axis(jnp.stack(per_kind), which[None], axis=0)[0]


def _distill_positions(batch: DistillBatch, config: OPDConfig, divergences: tuple[str, ...]
                       ) -> tuple[Callable[..., tuple[jax.Array, ...]], tuple[jax.Array, ...]]:
    """What `sequence_positions` evaluates at each position for a divergence loss, chunk by chunk
    through the LM head: (the function: the token's log-prob and entropy and the divergence to the
    row's teacher; its per-token inputs)."""
    kinds = tuple(dict.fromkeys(divergences))
    which = jnp.asarray([kinds.index(k) for k in divergences], jnp.int32)[batch.teacher_index]  # [B]
    which = jnp.broadcast_to(which[:, None], batch.rollout.tokens.shape)
    top_k = config.loss == "top_k"
    inputs = (batch.teacher_logprobs, which, *((batch.teacher_ids,) if top_k else ()))

    def at(logits: jax.Array, targets: jax.Array, teacher: jax.Array, which: jax.Array,
           ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        logp, entropy = picked_and_entropy(logits, targets)
        return logp, entropy, _position_divergence(logits, teacher, ids, which, config, kinds)
    return at, inputs


def _update(state: PolicyState, params: nnx.State, opt_state, targets: _OPDTargets, config: OPDConfig,
            temperature: float, divergences: tuple[str, ...]):
    s = config.surrogate
    normalizer = loss_denominator(targets.mask, s.loss_agg)
    use_surrogate = config.loss == "sampled" or config.reward_alpha > 0

    def loss_fn(p, t: _OPDTargets):
        rollout = t.batch.rollout
        run = dict(unroll=config.update.layer_unroll, temperature=temperature, replay=config.routing_replay == "r3",
                   dropout_key=training_key(state.step, rollout.tokens), index_replay=config.index_replay)
        # the LM head in chunks of positions (no [B, T, V]): the sampled tokens' log-probs, and for
        # a divergence loss each position's divergence to its teacher beside them
        if config.loss == "sampled":
            logp, entropy = sequence_logprobs(state.graphdef, p, rollout, with_entropy=True, **run)
        else:
            logp, entropy, per_position = sequence_positions(state.graphdef, p, rollout,
                                                             *_distill_positions(t.batch, config, divergences), **run)
        loss = jnp.zeros(())
        metrics = {}
        weights = current_policy_weights(t.weights, logp, rollout.logp_infer, t.mask, s.mismatch, t.advantages)
        if use_surrogate:
            loss, metrics = policy_loss(logp, rollout.logp_old, t.advantages, t.mask, eps_low=s.eps_low,
                                        eps_high=s.eps_high, dual_clip=s.dual_clip, weights=weights,
                                        agg=s.loss_agg, normalizer=normalizer, kind=s.kind)
        if config.loss != "sampled":
            if t.batch.row_weights is not None:
                per_position = per_position * t.batch.row_weights[:, None]
            distill, _, _ = aggregate(weights * per_position, t.mask, s.loss_agg, normalizer)
            metrics = {**metrics, "distill_loss": summed_loss(distill)}
            if use_surrogate:
                metrics["reward_loss"] = summed_loss(loss)
            loss = loss + distill
        entropy_mean, _, _ = aggregate(entropy, t.mask, s.loss_agg, normalizer)
        metrics = {**metrics, "loss": summed_loss(loss), "entropy": summed_loss(entropy_mean)}
        if s.entropy_coef > 0:
            loss = loss - s.entropy_coef * entropy_mean
        return loss, metrics

    grads, metrics = accumulate_grads(loss_fn, params, targets, config.update.microbatches, lambda t: t.mask,
                                      loss_scale_of(opt_state))
    params, opt_state, apply_metrics = apply_update(state.tx, params, opt_state, grads)
    return params, opt_state, {**metrics, **apply_metrics}


def opd_step(state: PolicyState, batch: DistillBatch, *, config: OPDConfig, group_size: int = 1,
             num_teachers: int = 1, temperature: float = 1.0, divergences: tuple[str, ...] | None = None
             ) -> tuple[PolicyState, dict[str, jax.Array]]:
    """One OPD iteration on a scored batch (see the module docstring). group_size: samples per
    prompt (the reward advantage's groups); num_teachers: how many teachers teacher_index ranges
    over; temperature: the engine's sampling temperature (student and teachers scored at it);
    divergences: each teacher's own divergence for loss full / top_k (None: config.divergence for all).
    Metrics are combined over the epochs × mini-batches updates (maxima kept): "student/*" from the
    updates, and batch statistics: the sampled reverse KL to the teachers ("opd/reverse_kl", and
    per teacher as one array [num_teachers], PER_TEACHER_KL), reward, length, mismatch."""
    if group_size < 1 or num_teachers < 1 or temperature <= 0:
        raise ValueError(f"opd_step needs group_size >= 1, num_teachers >= 1 and temperature > 0, got "
                         f"{group_size}, {num_teachers}, {temperature}")
    divergences = tuple(divergences) if divergences is not None else (config.divergence,) * num_teachers
    if len(divergences) != num_teachers or not set(divergences) <= set(DIVERGENCES):
        raise ValueError(f"opd_step needs one divergence per teacher ({num_teachers}) among {', '.join(DIVERGENCES)}, "
                         f"got {divergences}")
    if config.loss == "sampled" and set(divergences) != {"reverse_kl"}:
        raise ValueError("per-teacher divergences other than reverse_kl need loss 'full' or 'top_k'")
    _check(batch, config, group_size)
    targets, stats = _targets(batch, config, group_size, num_teachers)

    def update(carry, mb: _OPDTargets):
        params, opt_state = carry
        params, opt_state, metrics = _update(state, params, opt_state, mb, config, temperature, divergences)
        return (params, opt_state), prefixed("student/", metrics)

    (params, opt_state), metrics = run_updates(update, (state.params, state.opt), targets, config.update)
    metrics.update(stats)
    return state.replace(step=state.step + 1, params=params, opt=opt_state), metrics
