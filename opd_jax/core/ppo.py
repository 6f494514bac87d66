"""The PPO step with a learned critic (GLM-5.2 recipe): one pure function of (state, batch).

    score_batch(state, batch)  -> batch with θ_old log-probs and critic values      (one pass)
    ppo_step(state, batch)     -> (state, metrics)

ppo_step: token rewards (outcome on the last response token, optionally minus a KL penalty),
GAE advantages with λ_policy and critic returns with λ_critic from the θ_old values, mismatch
weights (IcePop by default) from θ_old vs engine log-probs, then `epochs` passes over
`minibatches` mini-batches, each one optimizer update of the policy (clipped surrogate) and of
the critic (clipped value loss), with gradients summed over `microbatches` micro-batches so the
update equals the mini-batch's exactly. Mini-batch j holds rows j, j+M, j+2M, ... (micro-batches
likewise; see `opd_jax.core.update`). An update whose gradients are not finite is skipped
(params and optimizer state kept) and counted in the metrics. During the first
`value_warmup_steps` steps only the critic trains (VAPO's value pretraining).

Nothing here jits or shards: the caller jits `functools.partial(ppo_step, config=...)` with the
shardings from `opd_jax.parallel` and donates the state.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from opd_jax.core.advantages import gae, group_advantages, length_adaptive_lambda, outcome_rewards, whiten
from opd_jax.core.batch import RolloutBatch
from opd_jax.core.distributions import shift_right, token_logprobs
from opd_jax.core.losses import (
    Aggregation,
    KLKind,
    aggregate,
    check_surrogate,
    kl_estimate,
    loss_denominator,
    policy_loss,
    value_loss,
)
from opd_jax.core.mismatch import MismatchCorrection, mismatch_metrics, mismatch_weights
from opd_jax.core.update import accumulate_grads, apply_update, check_batch_split, map_rows, scan_or_call, split_rows
from opd_jax.models import Decoder, ValueModel


@dataclasses.dataclass(frozen=True)
class KLConfig:
    """KL to a frozen reference; off by default (GLM-5.2 removed it). `where`: "loss" adds
    coef·KL(π_θ ‖ π_ref) to the policy loss; "reward" subtracts coef·KL(π_old ‖ π_ref) from each
    token's reward before GAE."""

    coef: float = 0.0
    kind: KLKind = "low-var"
    where: Literal["loss", "reward"] = "loss"

    def __post_init__(self):
        if self.coef < 0:
            raise ValueError(f"kl.coef must be >= 0, got {self.coef}")
        if self.kind not in ("k1", "k2", "k3", "low-var"):
            raise ValueError(f"unknown KL estimator {self.kind!r}; use 'k1', 'k2', 'k3' or 'low-var'")
        if self.where not in ("loss", "reward"):
            raise ValueError(f"kl.where must be 'loss' or 'reward', got {self.where!r}")

    @property
    def enabled(self) -> bool:
        return self.coef > 0


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Every knob of the step. λ_policy = "adaptive" is VAPO's 1 − 1/(α·len), α = adaptive_alpha.
    advantage = "grpo" replaces GAE by the group baseline over consecutive groups of `group_size`
    samples (same advantage on every token of a sample) and leaves the critic untouched."""

    advantage: Literal["gae", "grpo"] = "gae"
    group_size: int = 1
    # the engine's sampling temperature: log-probs are of log_softmax(logits / T), as the engine
    # reports them, so the ratios compare like with like (T = 0, greedy, scores at T = 1)
    temperature: float = 1.0
    grpo_normalize_std: bool = True
    gamma: float = 1.0
    lam_policy: float | Literal["adaptive"] = 0.95
    lam_critic: float = 1.0
    adaptive_alpha: float = 0.05
    whiten_advantages: bool = False
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    loss_agg: Aggregation = "token-mean"
    mismatch: MismatchCorrection = MismatchCorrection()
    kl: KLConfig = KLConfig()
    entropy_coef: float = 0.0
    epochs: int = 1
    minibatches: int = 1
    microbatches: int = 1
    value_warmup_steps: int = 0
    # Layers per scan iteration in the training forward/backward (True: all of them). Unrolled
    # compiles slower and trains faster: 8.7 s vs 10.4 s per step on the 21M benchmark, CPU.
    layer_unroll: int | bool = True

    def __post_init__(self):
        if self.advantage not in ("gae", "grpo"):
            raise ValueError(f"advantage must be 'gae' or 'grpo', got {self.advantage!r}")
        for name in ("epochs", "minibatches", "microbatches", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy rollouts score at 1.0), got {self.temperature}")
        if self.value_warmup_steps < 0:
            raise ValueError(f"value_warmup_steps must be >= 0, got {self.value_warmup_steps}")
        if self.lam_policy != "adaptive" and not 0 <= self.lam_policy <= 1:
            raise ValueError(f"lam_policy must be in [0, 1] or 'adaptive', got {self.lam_policy!r}")
        if not (0 <= self.lam_critic <= 1 and 0 <= self.gamma <= 1):
            raise ValueError("gamma and lam_critic must be in [0, 1]")
        check_surrogate(self.eps_low, self.eps_high, self.dual_clip, self.loss_agg)

    def check_batch_size(self, batch_size: int) -> None:
        check_batch_split(batch_size, self.minibatches, self.microbatches,
                          self.group_size if self.advantage == "grpo" else None)


@flax.struct.dataclass
class PPOState:
    """Policy and critic parameters (nnx.State, which keeps each parameter's logical axes) and
    their optimizer states, plus the step count. The graph definitions and optimizers are static."""

    step: jax.Array
    policy: nnx.State
    critic: nnx.State
    policy_opt: optax.OptState
    critic_opt: optax.OptState
    policy_def: nnx.GraphDef = flax.struct.field(pytree_node=False)
    critic_def: nnx.GraphDef = flax.struct.field(pytree_node=False)
    policy_tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    critic_tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

    @classmethod
    def create(cls, policy: Decoder, critic: ValueModel, policy_tx: optax.GradientTransformation,
               critic_tx: optax.GradientTransformation) -> PPOState:
        policy_def, policy_params = nnx.split(policy, nnx.Param)
        critic_def, critic_params = nnx.split(critic, nnx.Param)
        return cls(step=jnp.zeros((), jnp.int32), policy=policy_params, critic=critic_params,
                   policy_opt=policy_tx.init(policy_params), critic_opt=critic_tx.init(critic_params),
                   policy_def=policy_def, critic_def=critic_def, policy_tx=policy_tx, critic_tx=critic_tx)

    def policy_model(self) -> Decoder:
        return nnx.merge(self.policy_def, self.policy)

    def critic_model(self) -> ValueModel:
        return nnx.merge(self.critic_def, self.critic)


# --- forward passes -------------------------------------------------------------------------

def sequence_logits(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *, unroll: int | bool = 1,
                    temperature: float = 1.0) -> jax.Array:
    """logits / temperature of the decoder (graphdef, params) on batch.tokens: [B, T, V]."""
    logits = nnx.merge(graphdef, params)(batch.tokens, positions=batch.positions,
                                         attention_mask=batch.attention_mask, unroll=unroll)
    return logits / temperature if temperature != 1.0 else logits


def sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *,
                      with_entropy: bool = False, unroll: int | bool = 1, temperature: float = 1.0
                      ) -> tuple[jax.Array, jax.Array | None]:
    """Per-token log-probs (and entropies) of batch.tokens under the decoder (graphdef, params),
    of the distribution softmax(logits / temperature)."""
    logits = sequence_logits(graphdef, params, batch, unroll=unroll, temperature=temperature)
    return token_logprobs(logits, batch.tokens, with_entropy=with_entropy)


def sequence_values(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *,
                    unroll: int | bool = 1) -> jax.Array:
    """V(tokens[:t]) at each position t: the critic's output on the prefix before token t."""
    values = nnx.merge(graphdef, params)(batch.tokens, positions=batch.positions,
                                         attention_mask=batch.attention_mask, unroll=unroll)
    return shift_right(values)


def score_batch(state: PPOState, batch: RolloutBatch, *, microbatches: int = 1,
                temperature: float = 1.0) -> RolloutBatch:
    """The batch with logp_old (θ_old = state.policy, at the engine's sampling temperature) and
    old_values (state.critic) filled in, computed in `microbatches` slices. Zero off the mask."""
    def score(b: RolloutBatch):
        logp, _ = sequence_logprobs(state.policy_def, state.policy, b, temperature=temperature)
        return logp, sequence_values(state.critic_def, state.critic, b)

    logp_old, old_values = map_rows(score, batch, microbatches)
    m = batch.response_mask.astype(jnp.float32)
    return batch.replace(logp_old=logp_old * m, old_values=old_values * m)


def policy_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *, temperature: float = 1.0,
                    microbatches: int = 1) -> jax.Array:
    """Per-token log-probs under fixed parameters, at softmax(logits / temperature), in
    `microbatches` slices, zero off the response mask: a frozen reference for the KL term, or
    the OPD student's θ_old."""
    logp = map_rows(lambda b: sequence_logprobs(graphdef, params, b, temperature=temperature)[0], batch,
                    microbatches)
    return logp * batch.response_mask.astype(jnp.float32)


# --- the step -------------------------------------------------------------------------------

@flax.struct.dataclass
class _Targets:
    """What one optimizer update trains on, per token [rows, T] (see ppo_step)."""

    batch: RolloutBatch
    mask: jax.Array
    advantages: jax.Array
    returns: jax.Array
    weights: jax.Array


def _policy_update(state: PPOState, params, opt_state, targets: _Targets, config: PPOConfig):
    normalizer = loss_denominator(targets.mask, config.loss_agg)
    use_entropy = config.entropy_coef > 0
    use_kl_loss = config.kl.enabled and config.kl.where == "loss"

    def loss_fn(p, t: _Targets):
        logp, entropy = sequence_logprobs(state.policy_def, p, t.batch, with_entropy=True,
                                          unroll=config.layer_unroll, temperature=config.temperature)
        loss, metrics = policy_loss(logp, t.batch.logp_old, t.advantages, t.mask, eps_low=config.eps_low,
                                    eps_high=config.eps_high, dual_clip=config.dual_clip, weights=t.weights,
                                    agg=config.loss_agg, normalizer=normalizer)
        entropy_mean, _, _ = aggregate(entropy, t.mask, config.loss_agg, normalizer)
        metrics = {**metrics, "loss": jax.lax.stop_gradient(loss), "entropy": jax.lax.stop_gradient(entropy_mean)}
        if use_entropy:
            loss = loss - config.entropy_coef * entropy_mean
        if use_kl_loss:
            kl, _, _ = aggregate(kl_estimate(logp, t.batch.logp_ref, config.kl.kind), t.mask, config.loss_agg,
                                 normalizer)
            loss = loss + config.kl.coef * kl
            metrics["kl_loss"] = jax.lax.stop_gradient(kl)
        metrics["total_loss"] = jax.lax.stop_gradient(loss)
        return loss, metrics

    grads, metrics = accumulate_grads(loss_fn, params, targets, config.microbatches, lambda t: t.mask)
    params, opt_state, apply_metrics = apply_update(state.policy_tx, params, opt_state, grads)
    return params, opt_state, {**metrics, **apply_metrics}


def _critic_update(state: PPOState, params, opt_state, targets: _Targets, config: PPOConfig):
    normalizer = jnp.sum(targets.mask)

    def loss_fn(p, t: _Targets):
        values = sequence_values(state.critic_def, p, t.batch, unroll=config.layer_unroll)
        loss, metrics = value_loss(values, t.batch.old_values, t.returns, t.mask, clip=config.value_clip,
                                   normalizer=normalizer)
        return loss, {**metrics, "loss": jax.lax.stop_gradient(loss)}

    grads, metrics = accumulate_grads(loss_fn, params, targets, config.microbatches, lambda t: t.mask)
    params, opt_state, apply_metrics = apply_update(state.critic_tx, params, opt_state, grads)
    return params, opt_state, {**metrics, **apply_metrics}


def _targets(batch: RolloutBatch, config: PPOConfig) -> tuple[_Targets, dict[str, jax.Array]]:
    m = batch.response_mask.astype(jnp.float32)
    token_rewards = outcome_rewards(batch.rewards, m)
    stats = {}
    if config.kl.enabled and config.kl.where == "reward":
        kl = kl_estimate(batch.logp_old, batch.logp_ref, config.kl.kind) * m
        token_rewards = token_rewards - config.kl.coef * kl
        stats["kl_reward"] = jnp.sum(kl) / jnp.maximum(jnp.sum(m), 1.0)
    lam_policy = length_adaptive_lambda(m, config.adaptive_alpha) if config.lam_policy == "adaptive" \
        else config.lam_policy
    if config.advantage == "grpo":
        group = group_advantages(batch.rewards, config.group_size, normalize_std=config.grpo_normalize_std)
        advantages = group[:, None] * m
    else:
        advantages, _ = gae(token_rewards, batch.old_values, m, config.gamma, lam_policy)
    _, returns = gae(token_rewards, batch.old_values, m, config.gamma, config.lam_critic)
    if config.whiten_advantages:
        advantages = whiten(advantages, m)
    weights = mismatch_weights(batch.logp_old, batch.logp_infer, m, config.mismatch)
    n = jnp.maximum(jnp.sum(m), 1.0)
    masked_mean = lambda x: jnp.sum(x * m) / n  # noqa: E731
    residual_var = masked_mean(jnp.square(returns - batch.old_values - masked_mean(returns - batch.old_values)))
    returns_var = masked_mean(jnp.square(returns - masked_mean(returns)))
    token_inputs = [x for x in (batch.logp_infer, batch.logp_old, batch.old_values, batch.logp_ref) if x is not None]
    stats.update({
        # validate_batch refuses these on the host; this count catches what slips past it
        "nonfinite_inputs": jnp.sum(~jnp.isfinite(batch.rewards)).astype(jnp.float32)
        + sum(jnp.sum((m > 0) & ~jnp.isfinite(x)) for x in token_inputs).astype(jnp.float32),
        "reward_mean": jnp.mean(batch.rewards.astype(jnp.float32)),
        "response_length_mean": jnp.mean(jnp.sum(m, axis=1)),
        "advantage_mean": masked_mean(advantages),
        "advantage_std": jnp.sqrt(masked_mean(jnp.square(advantages - masked_mean(advantages)))),
        "return_mean": masked_mean(returns),
        "value_mean": masked_mean(batch.old_values),
        "value_explained_variance": 1.0 - residual_var / jnp.maximum(returns_var, 1e-8),
        **mismatch_metrics(batch.logp_old, batch.logp_infer, m),
    })
    return _Targets(batch=batch, mask=m, advantages=advantages, returns=returns, weights=weights), stats


def ppo_step(state: PPOState, batch: RolloutBatch, *, config: PPOConfig) -> tuple[PPOState, dict[str, jax.Array]]:
    """One PPO iteration on a scored batch (see the module docstring). Metrics are averaged over
    the epochs x mini-batches updates (maxima kept): "policy/*", "critic/*", and batch stats."""
    if batch.logp_old is None or batch.old_values is None:
        raise ValueError("ppo_step needs batch.logp_old and batch.old_values: run score_batch first")
    if config.kl.enabled and batch.logp_ref is None:
        raise ValueError("a KL term is on (kl.coef > 0) but batch.logp_ref is missing: run policy_logprobs "
                         "with the reference's parameters")
    config.check_batch_size(batch.tokens.shape[0])
    targets, stats = _targets(batch, config)
    minibatches = jax.tree.map(lambda x: split_rows(x, config.minibatches), targets)
    train_policy = state.step >= config.value_warmup_steps

    def update(carry, mb: _Targets):
        policy, policy_opt, critic, critic_opt = carry
        policy_branch = lambda: _policy_update(state, policy, policy_opt, mb, config)  # noqa: E731
        skipped = jax.tree.map(jnp.zeros_like, jax.eval_shape(policy_branch)[2])
        policy, policy_opt, policy_metrics = jax.lax.cond(
            train_policy, policy_branch, lambda: (policy, policy_opt, skipped))
        metrics = {f"policy/{k}": v for k, v in policy_metrics.items()}
        if config.advantage == "gae":  # GRPO has no critic to train
            critic, critic_opt, critic_metrics = _critic_update(state, critic, critic_opt, mb, config)
            metrics.update({f"critic/{k}": v for k, v in critic_metrics.items()})
        return (policy, policy_opt, critic, critic_opt), metrics

    def epoch(carry, _):
        return scan_or_call(update, carry, minibatches, config.minibatches)

    carry = (state.policy, state.policy_opt, state.critic, state.critic_opt)
    (policy, policy_opt, critic, critic_opt), per_update = scan_or_call(epoch, carry, None, config.epochs)
    metrics = {name: jnp.max(v) if name.endswith("_max") else jnp.mean(v) for name, v in per_update.items()}
    metrics.update(stats)
    metrics["policy/trained"] = train_policy.astype(jnp.float32)
    new_state = state.replace(step=state.step + 1, policy=policy, policy_opt=policy_opt, critic=critic,
                              critic_opt=critic_opt)
    return new_state, metrics
