"""The PPO step with a learned critic (GLM-5.2 recipe): one pure function of (state, batch).

    score_batch(state, batch)  -> batch with θ_old log-probs and critic values      (one pass)
    ppo_step(state, batch)     -> (state, metrics)

ppo_step: token rewards (outcome on the last response token, or a multi-turn episode's per-turn
rewards on each turn's last model token; optionally minus a KL penalty), GAE advantages with
λ_policy and critic returns with λ_critic from the θ_old values (observation tokens are holes; a
truncated episode bootstraps from the critic's value where it stopped), mismatch
weights (IcePop by default) from θ_old vs engine log-probs, then `epochs` passes over
`minibatches` mini-batches, each one optimizer update of the policy (clipped surrogate) and of
the critic (clipped value loss), with gradients summed over `microbatches` micro-batches so the
update equals the mini-batch's exactly (`config.update`; mini-batch j holds rows j, j+M, j+2M,
..., see `opd_jax.core.update`). An update whose gradients are not finite is skipped
(params and optimizer state kept) and counted in the metrics. During the first
`value_warmup_steps` steps only the critic trains (VAPO's value pretraining); a critic-free
estimator has none to warm, and its policy trains from the first step.

Nothing here jits or shards: the caller jits `functools.partial(ppo_step, config=...,
group_size=..., temperature=...)` with the shardings from `opd_jax.parallel` and donates the
state. group_size (samples per prompt) and temperature (the engine's sampling temperature) are
facts of the run, not knobs: the caller passes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from opd_jax.core import algorithms  # noqa: F401  (registers the algorithm files' parts)
from opd_jax.core.advantages import gae, outcome_rewards, whiten
from opd_jax.core.batch import RolloutBatch
from opd_jax.core.forward import RoutingReplay, sequence_logprobs, sequence_values, training_key, values_and_final
from opd_jax.core.losses import (
    KLKind,
    SurrogateConfig,
    aggregate,
    kl_estimate,
    loss_denominator,
    policy_loss,
    value_loss,
)
from opd_jax.core.metrics import First, prefixed
from opd_jax.core.mismatch import current_policy_weights, mismatch_weights
from opd_jax.core.optim import loss_scale_of
from opd_jax.core.registry import ADVANTAGE_ESTIMATORS, AdvantageInputs, Part
from opd_jax.core.router import router_losses
from opd_jax.core.update import (
    UpdateConfig,
    accumulate_grads,
    apply_update,
    batch_statistics,
    map_rows,
    run_updates,
    summed_loss,
    trainable,
)
from opd_jax.models import Decoder, ValueModel


@dataclasses.dataclass(frozen=True)
class KLConfig:
    """KL to a frozen reference (the policy as RL starts: `PPOState.reference`, held only when
    coef > 0); off by default (GLM-5.2 removed it). `where`: "loss" adds
    coef·KL(π_θ ‖ π_ref) to the policy loss; "reward" subtracts coef·KL(π_old ‖ π_ref) from each
    token's reward before GAE."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    coef: float = 0.0
    """Weight of the KL to a frozen reference; 0 (the default, as GLM-5.2): off."""
    kind: KLKind = "low-var"
    """Estimator: k1, k2, k3 or low-var (k3 clamped, as verl)."""
    where: Literal["loss", "reward"] = "loss"
    """loss: add coef·KL to the policy loss; reward: subtract it from each token's reward."""

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
    """Every knob of the step. `advantage` names a registered estimator (`ADVANTAGE_ESTIMATORS`)
    or a user's by import path, called with `advantage_params`; only one that needs the critic
    (gae) has one built, scored and trained. λ_policy = "adaptive" is VAPO's 1 − 1/(α·len), α =
    adaptive_alpha. The group baselines (grpo, rloo, reinforce++) work over consecutive groups of
    the run's samples per prompt (`core.advantages`). `surrogate`: the clipped, mismatch-weighted
    policy loss; `update`: epochs, mini-batches, micro-batches (both shared with the OPD step)."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    advantage: str = "gae"
    """The advantage estimator, by registered name or 'module:function'; only one that needs the critic (GAE, the GLM-5.2 recipe) has one built."""  # noqa: E501
    advantage_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The estimator's own parameters (keyword arguments of its function; for one given by import path)."""
    grpo_normalize_std: bool = True
    """GRPO: divide by the group's reward std (false: Dr.GRPO)."""
    gamma: float = 1.0
    """Discount γ of GAE (LLM practice: 1)."""
    lam_policy: float | Literal["adaptive"] = 0.95
    """GAE λ for the policy's advantages, or adaptive: VAPO's 1 − 1/(α·length)."""
    lam_critic: float = 1.0
    """GAE λ for the critic's returns."""
    adaptive_alpha: float = 0.05
    """α of the length-adaptive λ."""
    whiten_advantages: bool = False
    """Normalise advantages to mean 0, std 1 over the batch's response tokens."""
    value_clip: float | None = 0.2
    """Clip the critic's value to V_old ± value_clip in its loss; unset: no clipping."""
    surrogate: SurrogateConfig = SurrogateConfig()
    """The clipped, mismatch-weighted policy loss (shared with OPD)."""
    kl: KLConfig = KLConfig()
    """KL to a frozen reference (off by default)."""
    update: UpdateConfig = UpdateConfig()
    """Epochs, mini-batches and micro-batches of each step (shared with OPD)."""
    value_warmup_steps: int = 0
    """Steps at the start that train only the critic (VAPO's value pretraining); none for a critic-free advantage."""
    router_balance_coef: float = 0.0
    """MoE: weight of the load-balancing loss E·Σ f_e·P_e (transformers' formulation); off for RL, as slime."""
    router_z_coef: float = 0.0
    """MoE: weight of the router z-loss mean(logsumexp(router logits)²); off by default."""
    routing_replay: RoutingReplay = "none"
    """MoE: r3 scores θ_old and trains with the engine's experts for every token it routed (gates: the trainer's router)."""
    index_replay: bool = False
    """DSA (GLM-5): score θ_old and train attending the keys the engine's indexers chose for every token it recorded (composes with routing_replay)."""  # noqa: E501
    old_logprobs: Literal["recompute", "engine"] = "recompute"
    """θ_old's log-probs: recompute (the trainer scores the batch before the step) or engine (the sampler's own, no scoring pass: the ratio is taken against the engine, verl's bypass mode; a correction between θ_old and the engine then has nothing to correct)."""  # noqa: E501

    def __post_init__(self):
        self.estimator.check_params(self.advantage_params, fixed=2)
        mismatch = self.surrogate.mismatch
        if self.old_logprobs == "engine" and mismatch.kind != "none" and not mismatch.needs_current_policy:
            raise ValueError(f"old_logprobs engine takes the engine's log-probs as θ_old, so {mismatch.kind} (a "
                             f"correction between θ_old and the engine) has nothing to correct: set "
                             f"surrogate.mismatch.kind none, or one that needs the current policy (offpolicy-mask)")
        if self.value_warmup_steps < 0:
            raise ValueError(f"value_warmup_steps must be >= 0, got {self.value_warmup_steps}")
        if self.lam_policy != "adaptive" and not 0 <= self.lam_policy <= 1:
            raise ValueError(f"lam_policy must be in [0, 1] or 'adaptive', got {self.lam_policy!r}")
        if not (0 <= self.lam_critic <= 1 and 0 <= self.gamma <= 1):
            raise ValueError("gamma and lam_critic must be in [0, 1]")

    def __hash__(self) -> int:  # advantage_params is a dict; configs compare by value
        return hash(repr(self))

    @property
    def estimator(self) -> Part:
        return ADVANTAGE_ESTIMATORS.get(self.advantage)

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs the learned critic (only then is one built and trained)."""
        return "critic" in self.estimator.needs

    def check_group_size(self, group_size: int) -> None:
        """ValueError when the estimator needs ≥ 2 samples per prompt and the run has fewer."""
        if "pairs" in self.estimator.needs and group_size < 2:
            raise ValueError(f"advantage {self.advantage} needs at least 2 samples per prompt (each sample's "
                             f"baseline is the others of its prompt), got {group_size}")

    def check_batch_size(self, batch_size: int, group_size: int = 1) -> None:
        self.update.check_batch_size(batch_size, group_size if "group" in self.estimator.needs else None)


@flax.struct.dataclass
class PPOState:
    """Policy and critic parameters (nnx.State, which keeps each parameter's logical axes) and
    their optimizer states, plus the step count. The graph definitions and optimizers are static.
    A run whose estimator needs no critic has none: critic, critic_opt, critic_def and
    critic_tx are None (nothing of it is held, scored, trained or checkpointed). `reference`: the
    frozen parameters a KL term measures the policy against (the policy as the state was created,
    i.e. after the warm start; checkpointed with the state, never trained), None when no KL is on."""

    step: jax.Array
    policy: nnx.State
    critic: nnx.State | None
    policy_opt: optax.OptState
    critic_opt: optax.OptState | None
    policy_def: nnx.GraphDef = flax.struct.field(pytree_node=False)
    critic_def: nnx.GraphDef | None = flax.struct.field(pytree_node=False)
    policy_tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    critic_tx: optax.GradientTransformation | None = flax.struct.field(pytree_node=False)
    reference: nnx.State | None = None

    @classmethod
    def create(cls, policy: Decoder, critic: ValueModel | None, policy_tx: optax.GradientTransformation,
               critic_tx: optax.GradientTransformation | None, *, reference: bool = False) -> PPOState:
        """reference: also hold a frozen copy of the policy's parameters (for a KL term)."""
        policy_def, policy_params = nnx.split(policy, nnx.Param)
        critic_def, critic_params = nnx.split(critic, nnx.Param) if critic is not None else (None, None)
        # a copy, not the same buffers: the step donates the state, policy and reference alike
        frozen = jax.tree.map(jnp.copy, policy_params) if reference else None
        return cls(step=jnp.zeros((), jnp.int32), policy=policy_params, critic=critic_params,
                   policy_opt=policy_tx.init(trainable(policy_params)),
                   critic_opt=None if critic is None else critic_tx.init(trainable(critic_params)),
                   policy_def=policy_def, critic_def=critic_def, policy_tx=policy_tx,
                   critic_tx=None if critic is None else critic_tx, reference=frozen)

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    def policy_model(self) -> Decoder:
        return nnx.merge(self.policy_def, self.policy)

    def critic_model(self) -> ValueModel:
        return nnx.merge(self.critic_def, self.critic)


# --- the scoring pass --------------------------------------------------------------------

def score_batch(state: PPOState, batch: RolloutBatch, *, microbatches: int = 1,
                temperature: float = 1.0, routing_replay: bool = False, index_replay: bool = False,
                old_logprobs: Literal["recompute", "engine"] = "recompute") -> RolloutBatch:
    """The batch with logp_old (θ_old = state.policy, at the engine's sampling temperature),
    old_values (state.critic) and end_values (the critic's value of each whole row, which a
    truncated episode bootstraps from) filled in, computed in `microbatches` slices. Per-token
    ones are zero off the mask. A state without a critic fills logp_old only (no value pass); a
    state with a reference also fills logp_ref (the reference's log-probs, for the KL term).
    routing_replay: a MoE policy scores with the engine's routing (batch.routing; R3); index_replay:
    a DSA policy with the engine's indexer choices (batch.indices).
    old_logprobs "engine": logp_old = logp_infer, the policy's forward pass skipped (bypass mode)."""
    def logprobs(params: nnx.State, b: RolloutBatch) -> jax.Array:
        return sequence_logprobs(state.policy_def, params, b, temperature=temperature, replay=routing_replay,
                                 index_replay=index_replay)[0]

    def scores(b: RolloutBatch) -> dict[str, jax.Array]:
        out = {"logp_old": b.logp_infer if old_logprobs == "engine" else logprobs(state.policy, b)}
        if state.reference is not None:
            out["logp_ref"] = logprobs(state.reference, b)
        if state.has_critic:
            out["old_values"], out["end_values"] = values_and_final(state.critic_def, state.critic, b)
        return out

    on = batch.response_mask > 0
    out = map_rows(scores, batch, microbatches)
    per_token = {k: jnp.where(on, v, 0.0) for k, v in out.items() if k != "end_values"}
    return batch.replace(**per_token, **({"end_values": out["end_values"]} if "end_values" in out else {}))


# --- the step -------------------------------------------------------------------------------

@flax.struct.dataclass
class _PPOTargets:
    """What one optimizer update trains on, per token [rows, T] (see ppo_step)."""

    batch: RolloutBatch
    mask: jax.Array
    advantages: jax.Array
    returns: jax.Array | None  # the critic's targets (None without a critic)
    weights: jax.Array


def _policy_update(state: PPOState, params, opt_state, targets: _PPOTargets, config: PPOConfig, temperature: float):
    surrogate = config.surrogate
    normalizer = loss_denominator(targets.mask, surrogate.loss_agg)
    use_kl_loss = config.kl.enabled and config.kl.where == "loss"

    tokens = jnp.maximum(jnp.sum(targets.batch.attention_mask), 1.0)  # the mini-batch's, for the router losses
    moe_layers = nnx.merge(state.policy_def, params).config.moe_layers

    def loss_fn(p, t: _PPOTargets):
        logp, entropy, router = sequence_logprobs(state.policy_def, p, t.batch, with_entropy=True,
                                                  unroll=config.update.layer_unroll, temperature=temperature,
                                                  with_router=True, replay=config.routing_replay == "r3",
                                                  dropout_key=training_key(state.step, t.batch.tokens),
                                                  index_replay=config.index_replay)
        weights = current_policy_weights(t.weights, logp, t.batch.logp_infer, t.mask, surrogate.mismatch, t.advantages)
        loss, metrics = policy_loss(logp, t.batch.logp_old, t.advantages, t.mask, eps_low=surrogate.eps_low,
                                    eps_high=surrogate.eps_high, dual_clip=surrogate.dual_clip, weights=weights,
                                    agg=surrogate.loss_agg, normalizer=normalizer, kind=surrogate.kind)
        entropy_mean, _, _ = aggregate(entropy, t.mask, surrogate.loss_agg, normalizer)
        metrics = {**metrics, "loss": summed_loss(loss), "entropy": summed_loss(entropy_mean),
                   # |log π_θ − log π_engine| at the step's first forward, where π_θ is still the
                   # trainer's θ_old: the mismatch, measured even where θ_old is not recomputed
                   "engine_abs_logp_diff": First(jnp.sum(jnp.where(t.mask > 0, jnp.abs(jax.lax.stop_gradient(logp)
                                                                                       - t.batch.logp_infer), 0.0))
                                                 / jnp.maximum(jnp.sum(t.mask), 1.0))}
        if surrogate.entropy_coef > 0:
            loss = loss - surrogate.entropy_coef * entropy_mean
        if use_kl_loss:
            kl, _, _ = aggregate(kl_estimate(logp, t.batch.logp_ref, config.kl.kind), t.mask, surrogate.loss_agg,
                                 normalizer)
            loss = loss + config.kl.coef * kl
            metrics["kl_loss"] = summed_loss(kl)
        if router is not None:
            share = jnp.sum(t.batch.attention_mask) / tokens  # this micro-batch's part of the mini-batch
            aux, router_metrics = router_losses(router, config.router_balance_coef, config.router_z_coef,
                                                moe_layers)
            loss = loss + share * aux
            metrics.update(router_metrics)
        metrics["total_loss"] = summed_loss(loss)
        return loss, metrics

    grads, metrics = accumulate_grads(loss_fn, params, targets, config.update.microbatches, lambda t: t.mask,
                                      loss_scale_of(opt_state))
    params, opt_state, apply_metrics = apply_update(state.policy_tx, params, opt_state, grads)
    return params, opt_state, {**metrics, **apply_metrics}


def _critic_update(state: PPOState, params, opt_state, targets: _PPOTargets, config: PPOConfig):
    normalizer = jnp.sum(targets.mask)

    def loss_fn(p, t: _PPOTargets):
        key = jax.random.fold_in(training_key(state.step, t.batch.tokens), 1)  # not the policy's masks
        values = sequence_values(state.critic_def, p, t.batch, unroll=config.update.layer_unroll, dropout_key=key)
        loss, metrics = value_loss(values, t.batch.old_values, t.returns, t.mask, clip=config.value_clip,
                                   normalizer=normalizer)
        return loss, {**metrics, "loss": summed_loss(loss)}

    grads, metrics = accumulate_grads(loss_fn, params, targets, config.update.microbatches, lambda t: t.mask,
                                      loss_scale_of(opt_state))
    params, opt_state, apply_metrics = apply_update(state.critic_tx, params, opt_state, grads)
    return params, opt_state, {**metrics, **apply_metrics}


def _token_rewards(batch: RolloutBatch, m: jax.Array, config: PPOConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each token's reward: the outcome on the last response token (or the episode's per-turn
    rewards), minus coef·KL(π_old ‖ π_ref) when the KL term sits in the reward."""
    token_rewards = outcome_rewards(batch.rewards, m) if batch.token_rewards is None else \
        jnp.where(m > 0, batch.token_rewards, 0.0)
    if not (config.kl.enabled and config.kl.where == "reward"):
        return token_rewards, {}
    kl = jnp.where(m > 0, kl_estimate(batch.logp_old, batch.logp_ref, config.kl.kind), 0.0)
    return token_rewards - config.kl.coef * kl, {"kl_reward": jnp.sum(kl) / jnp.maximum(jnp.sum(m), 1.0)}


def _critic_statistics(returns: jax.Array, values: jax.Array, masked_mean) -> dict[str, jax.Array]:
    residual_var = masked_mean(jnp.square(returns - values - masked_mean(returns - values)))
    returns_var = masked_mean(jnp.square(returns - masked_mean(returns)))
    return {"return_mean": masked_mean(returns), "value_mean": masked_mean(values),
            "value_explained_variance": 1.0 - residual_var / jnp.maximum(returns_var, 1e-8)}


def _targets(batch: RolloutBatch, config: PPOConfig, group_size: int) -> tuple[_PPOTargets, dict[str, jax.Array]]:
    m = batch.response_mask.astype(jnp.float32)
    token_rewards, stats = _token_rewards(batch, m, config)
    critic = config.uses_critic
    final = None
    if critic and batch.bootstrap is not None and batch.end_values is not None:
        final = jnp.where(batch.bootstrap > 0, batch.end_values, 0.0)
    inputs = AdvantageInputs(rewards=batch.rewards, token_rewards=token_rewards, mask=m,
                             values=batch.old_values if critic else None, final_values=final, group_size=group_size)
    advantages = config.estimator.fn(inputs, config, **config.advantage_params)
    chex.assert_shape(advantages, m.shape, custom_message=f"advantage estimator {config.advantage} must return [B, T]")
    advantages = jnp.where(m > 0, advantages.astype(jnp.float32), 0.0)
    if config.whiten_advantages:
        advantages = whiten(advantages, m)
    correction = config.surrogate.mismatch
    weights = mismatch_weights(batch.logp_old, batch.logp_infer, m, correction)
    n = jnp.maximum(jnp.sum(m), 1.0)
    masked_mean = lambda x: jnp.sum(jnp.where(m > 0, x, 0.0)) / n  # noqa: E731
    returns = gae(token_rewards, batch.old_values, m, config.gamma, config.lam_critic, final)[1] if critic else None
    token_inputs = [x for x in (batch.logp_infer, batch.logp_old, batch.old_values if critic else None, batch.logp_ref)
                    if x is not None]
    stats.update({
        **batch_statistics(batch.rewards, m, batch.logp_old, batch.logp_infer, token_inputs, correction),
        "advantage_mean": masked_mean(advantages),
        "advantage_std": jnp.sqrt(masked_mean(jnp.square(advantages - masked_mean(advantages)))),
        **(_critic_statistics(returns, batch.old_values, masked_mean) if critic else {}),
    })
    return _PPOTargets(batch=batch, mask=m, advantages=advantages, returns=returns, weights=weights), stats


def ppo_step(state: PPOState, batch: RolloutBatch, *, config: PPOConfig, group_size: int = 1,
             temperature: float = 1.0, with_targets: bool = False) -> tuple[PPOState, dict[str, jax.Array]]:
    """One PPO iteration on a scored batch (see the module docstring). group_size: samples per
    prompt (consecutive rows; GRPO's groups); temperature: the engine's sampling temperature, at
    which the policy's log-probs are taken (score_batch must use the same). Metrics are combined
    over the epochs x mini-batches updates (maxima kept): "policy/*", "critic/*", and batch stats;
    with_targets adds the [B, T] advantages and returns the updates used ("targets/advantages",
    "targets/returns"), as computed once for them (what logging.dump_rollouts writes)."""
    if config.uses_critic and not state.has_critic:
        raise ValueError(f"advantage {config.advantage} needs a critic, and the state has none: create it with one")
    if batch.logp_old is None or (config.uses_critic and batch.old_values is None):
        raise ValueError("ppo_step needs batch.logp_old (and, with a critic, batch.old_values): run score_batch first")
    if config.kl.enabled and batch.logp_ref is None:
        raise ValueError("a KL term is on (kl.coef > 0) but batch.logp_ref is missing: create the state with "
                         "PPOState.create(..., reference=True) and score the batch with score_batch")
    if group_size < 1 or temperature <= 0:
        raise ValueError(f"ppo_step needs group_size >= 1 and temperature > 0 (greedy rollouts score at 1.0), "
                         f"got {group_size}, {temperature}")
    config.check_batch_size(batch.tokens.shape[0], group_size)
    targets, stats = _targets(batch, config, group_size)
    # the warm-up trains the critic alone: with no critic there is nothing to warm, and the
    # policy trains from the first step (a critic-free run of a config that sets it lost those steps)
    train_policy = state.step >= (config.value_warmup_steps if config.uses_critic else 0)

    def update(carry, mb: _PPOTargets):
        policy, policy_opt, critic, critic_opt = carry
        policy_branch = lambda: _policy_update(state, policy, policy_opt, mb, config, temperature)  # noqa: E731
        skipped = jax.tree.map(jnp.zeros_like, jax.eval_shape(policy_branch)[2])
        policy, policy_opt, policy_metrics = jax.lax.cond(
            train_policy, policy_branch, lambda: (policy, policy_opt, skipped))
        metrics = prefixed("policy/", policy_metrics)
        if config.uses_critic:  # a critic-free estimator leaves any critic untouched
            critic, critic_opt, critic_metrics = _critic_update(state, critic, critic_opt, mb, config)
            metrics.update(prefixed("critic/", critic_metrics))
        return (policy, policy_opt, critic, critic_opt), metrics

    carry = (state.policy, state.policy_opt, state.critic, state.critic_opt)
    (policy, policy_opt, critic, critic_opt), metrics = run_updates(update, carry, targets, config.update)
    metrics.update(stats)
    metrics["policy/trained"] = train_policy.astype(jnp.float32)
    if with_targets:
        metrics["targets/advantages"] = targets.advantages
        if targets.returns is not None:
            metrics["targets/returns"] = targets.returns
    new_state = state.replace(step=state.step + 1, policy=policy, policy_opt=policy_opt, critic=critic,
                              critic_opt=critic_opt)
    return new_state, metrics


def advantages_and_returns(batch: RolloutBatch, *, config: PPOConfig,
                           group_size: int = 1) -> tuple[jax.Array, jax.Array | None]:
    """The advantages [B, T] (whitened when configured) and critic returns [B, T] (None when the
    estimator needs no critic) that `ppo_step` trains this scored batch on; for inspection
    (logging.dump_rollouts)."""
    targets, _ = _targets(batch, config, group_size)
    return targets.advantages, targets.returns
