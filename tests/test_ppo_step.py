"""The PPO step against an independent reference written from the formulas, plus its structure:
mini-batches, micro-batch accumulation, value warm-up, bf16 compute, non-finite guards."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from ppo_setup import TINY, assert_updates_close, make_state, rollout_batch, scored_batch, tiny_models
from test_core_losses import numpy_gae

from opd_jax.core import (
    BatchError,
    KLConfig,
    MismatchCorrection,
    OptimizerConfig,
    PPOConfig,
    PPOState,
    SurrogateConfig,
    UpdateConfig,
    make_optimizer,
    ppo_step,
    score_batch,
    validate_batch,
)


def host(x):
    return np.asarray(x, np.float64)


def reference_targets(batch, config):
    """Advantages, returns and mismatch weights in NumPy, from the batch's θ_old numbers."""
    m, logp_old, values = host(batch.response_mask), host(batch.logp_old), host(batch.old_values)
    B, T = m.shape
    rewards = np.zeros((B, T))
    for i in range(B):
        if m[i].sum():
            rewards[i, np.flatnonzero(m[i])[-1]] = float(batch.rewards[i])
    if config.kl.coef and config.kl.where == "reward":
        x = np.clip(logp_old - host(batch.logp_ref), -20, 20)
        rewards -= config.kl.coef * np.clip(np.exp(-x) - 1 + x, -10, 10) * m  # low-var
    adv = np.zeros((B, T))
    for i in range(B):
        lam = config.lam_policy
        if lam == "adaptive":
            lam = float(np.clip(1 - 1 / (config.adaptive_alpha * max(m[i].sum(), 1)), 0, 1))
        adv[i] = numpy_gae(rewards[i:i + 1], values[i:i + 1], m[i:i + 1], config.gamma, lam)[0]
    returns = numpy_gae(rewards, values, m, config.gamma, config.lam_critic)[1]
    k = np.exp(logp_old - host(batch.logp_infer)) * m
    kind, hi = config.surrogate.mismatch.kind, config.surrogate.mismatch.hi
    w = {"icepop": np.where((k >= 1 / hi) & (k <= hi), k, 0), "tis": np.clip(k, 0, hi),
         "none": np.ones_like(k)}[kind] * m
    return adv, returns, w


def aggregate(per_token, m, agg):
    if agg == "token-mean":
        return jnp.sum(per_token * m) / jnp.sum(m)
    rows = jnp.sum(m, 1)
    return jnp.sum(jnp.where(rows > 0, jnp.sum(per_token * m, 1) / jnp.maximum(rows, 1), 0)) / jnp.sum(rows > 0)


def reference_sgd_step(state, batch, config, lr):
    """Policy and critic after one SGD step on the PPO losses, spelled out from the formulas."""
    adv, returns, w = (jnp.asarray(x, jnp.float32) for x in reference_targets(batch, config))
    m = batch.response_mask
    tokens = batch.tokens
    positions = jnp.maximum(jnp.cumsum(batch.attention_mask, 1) - 1, 0)

    def policy_objective(params):
        logits = nnx.merge(state.policy_def, params)(tokens, positions=positions, attention_mask=batch.attention_mask)
        logsm = jax.nn.log_softmax(logits[:, :-1], -1)
        logp = jnp.pad(jnp.take_along_axis(logsm, tokens[:, 1:, None], -1)[..., 0], ((0, 0), (1, 0)))
        entropy = jnp.pad(-jnp.sum(jnp.exp(logsm) * logsm, -1), ((0, 0), (1, 0)))
        r = jnp.exp(logp - batch.logp_old)
        s = config.surrogate
        per = -w * jnp.minimum(r * adv, jnp.clip(r, 1 - s.eps_low, 1 + s.eps_high) * adv)
        if s.dual_clip:
            per = jnp.where(adv < 0, jnp.minimum(per, -w * s.dual_clip * adv), per)
        loss = aggregate(per, m, s.loss_agg) - s.entropy_coef * aggregate(entropy, m, s.loss_agg)
        if config.kl.coef and config.kl.where == "loss":
            x = logp - batch.logp_ref
            loss = loss + config.kl.coef * aggregate(jnp.exp(-x) - 1 + x, m, s.loss_agg)  # k3
        return loss

    def critic_objective(params):
        v = nnx.merge(state.critic_def, params)(tokens, positions=positions, attention_mask=batch.attention_mask)
        v = jnp.pad(v[:, :-1], ((0, 0), (1, 0)))
        v_clip = batch.old_values + jnp.clip(v - batch.old_values, -config.value_clip, config.value_clip)
        return jnp.sum(0.5 * jnp.maximum((v - returns) ** 2, (v_clip - returns) ** 2) * m) / jnp.sum(m)

    sgd = lambda params, g: jax.tree.map(lambda p, d: p - lr * d, params, g)
    return (sgd(state.policy, jax.grad(policy_objective)(state.policy)),
            sgd(state.critic, jax.grad(critic_objective)(state.critic)))


def assert_trees_close(a, b, rtol=2e-4):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * max(np.abs(y).max(), 1e-3))


NO_CORRECTION = SurrogateConfig(mismatch=MismatchCorrection("none"))

VARIANTS = {
    "glm5-default": PPOConfig(),
    "tis-seqmean-dualclip-adaptive": PPOConfig(surrogate=SurrogateConfig(mismatch=MismatchCorrection("tis", hi=1.5),
                                                                         loss_agg="seq-mean-token-mean", dual_clip=3.0),
                                               lam_policy="adaptive", adaptive_alpha=0.5),
    "kl-loss-entropy": PPOConfig(kl=KLConfig(coef=0.1, kind="k3", where="loss"),
                                 surrogate=SurrogateConfig(entropy_coef=0.01), gamma=0.99),
    "kl-reward-no-correction": PPOConfig(kl=KLConfig(coef=0.2, kind="low-var", where="reward"),
                                         surrogate=NO_CORRECTION, lam_policy=1.0),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_step_matches_reference_sgd_update(name):
    config = VARIANTS[name]
    lr = 0.05
    state = make_state(optax.sgd(lr), optax.sgd(lr))
    batch = scored_batch(state)
    if config.kl.coef:
        noise = np.random.default_rng(5).normal(scale=0.3, size=batch.tokens.shape).astype(np.float32)
        batch = batch.replace(logp_ref=(batch.logp_old + jnp.asarray(noise)) * batch.response_mask)
    ref_policy, ref_critic = reference_sgd_step(state, batch, config, lr)
    new, metrics = jax.jit(functools.partial(ppo_step, config=config))(state, batch)
    assert_updates_close(new.policy, ref_policy, state.policy)
    assert_updates_close(new.critic, ref_critic, state.critic)
    assert int(new.step) == 1
    # first and only update: the policy is still θ_old, so r = 1 exactly
    np.testing.assert_allclose(float(metrics["policy/ratio_mean"]), 1.0, atol=1e-6)
    assert float(metrics["policy/clip_frac_low"]) == float(metrics["policy/clip_frac_high"]) == 0.0
    _, returns, w = reference_targets(batch, config)
    m = host(batch.response_mask)
    np.testing.assert_allclose(float(metrics["return_mean"]), (returns * m).sum() / m.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["policy/weight_zero_frac"]), ((w == 0) & (m > 0)).sum() / m.sum(),
                               atol=1e-6)


def test_score_batch_matches_a_plain_forward():
    state = make_state(optax.sgd(0.1), optax.sgd(0.1))
    batch = rollout_batch()
    scored = score_batch(state, batch, microbatches=4)
    model = state.policy_model()
    logits = host(model(batch.tokens, attention_mask=batch.attention_mask))  # right padding: positions 0..T-1
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tokens, m = np.asarray(batch.tokens), host(batch.response_mask)
    ref = np.zeros(m.shape)
    ref[:, 1:] = np.take_along_axis(logsm[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(host(scored.logp_old), ref * m, atol=2e-5)
    values = host(state.critic_model()(batch.tokens, attention_mask=batch.attention_mask))
    np.testing.assert_allclose(host(scored.old_values), np.pad(values[:, :-1], ((0, 0), (1, 0))) * m, atol=2e-5)


def test_minibatches_are_sequential_updates_on_strided_rows():
    lr = 0.05
    config = PPOConfig(update=UpdateConfig(minibatches=2), surrogate=NO_CORRECTION)
    state = make_state(optax.sgd(lr), optax.sgd(lr))
    batch = scored_batch(state)
    new, _ = jax.jit(functools.partial(ppo_step, config=config))(state, batch)
    # by hand: GAE on the whole batch is per row, so update on rows 0,2,4,... then on 1,3,5,...
    one = PPOConfig(surrogate=NO_CORRECTION)
    rows = lambda b, j: jax.tree.map(lambda x: x[j::2], b)
    step_one = jax.jit(functools.partial(ppo_step, config=one))
    mid, _ = step_one(state, rows(batch, 0))
    ref, _ = step_one(mid, rows(batch, 1))
    assert_trees_close(new.policy, ref.policy, rtol=1e-5)
    assert_trees_close(new.critic, ref.critic, rtol=1e-5)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_micro_batch_accumulation_equals_one_batch(microbatches):
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0))
    state = make_state(tx, tx)
    batch = scored_batch(state)
    surrogate = SurrogateConfig(loss_agg="seq-mean-token-mean", entropy_coef=0.01)
    base = PPOConfig(update=UpdateConfig(epochs=2, minibatches=2), surrogate=surrogate)
    one, m1 = jax.jit(functools.partial(ppo_step, config=base))(state, batch)
    acc = PPOConfig(update=UpdateConfig(epochs=2, minibatches=2, microbatches=microbatches), surrogate=surrogate)
    many, mk = jax.jit(functools.partial(ppo_step, config=acc))(state, batch)
    # Adam divides by √v, so compare updates, relative to their size
    assert_updates_close(many.policy, one.policy, state.policy, rtol=2e-3)
    assert_updates_close(many.critic, one.critic, state.critic, rtol=2e-3)
    for name in m1:
        np.testing.assert_allclose(float(mk[name]), float(m1[name]), rtol=1e-4, atol=1e-6, err_msg=name)


def test_value_warmup_trains_only_the_critic_first():
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    state = make_state(tx, tx)
    batch = scored_batch(state)
    step = jax.jit(functools.partial(ppo_step, config=PPOConfig(value_warmup_steps=1)))
    first, m1 = step(state, batch)
    assert float(m1["policy/trained"]) == 0.0
    for a, b in zip(jax.tree.leaves(first.policy), jax.tree.leaves(state.policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(first.critic), jax.tree.leaves(state.critic)))
    second, m2 = step(first, score_batch(first, batch))
    assert float(m2["policy/trained"]) == 1.0
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(second.policy), jax.tree.leaves(first.policy)))
    # a critic-free estimator has no critic to warm: its policy trains from the first step
    free = functools.partial(ppo_step, config=PPOConfig(advantage="grpo", value_warmup_steps=5), group_size=4)
    trained, m3 = jax.jit(free)(state, batch)
    assert float(m3["policy/trained"]) == 1.0
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(trained.policy), jax.tree.leaves(state.policy)))


def test_bf16_compute_keeps_f32_master_weights_and_tracks_the_f32_update():
    tx = optax.sgd(0.05)
    f32 = make_state(tx, tx)
    bf16 = make_state(tx, tx, compute_dtype=jnp.bfloat16)
    batch = scored_batch(f32)
    config = PPOConfig()
    new32, _ = jax.jit(functools.partial(ppo_step, config=config))(f32, batch)
    new16, _ = jax.jit(functools.partial(ppo_step, config=config))(bf16, batch)
    d32 = np.concatenate([(np.asarray(a) - np.asarray(b)).ravel() for a, b in
                          zip(jax.tree.leaves(new32.policy), jax.tree.leaves(f32.policy))])
    d16 = np.concatenate([(np.asarray(a) - np.asarray(b)).ravel() for a, b in
                          zip(jax.tree.leaves(new16.policy), jax.tree.leaves(bf16.policy))])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new16.policy))
    cosine = d16 @ d32 / (np.linalg.norm(d16) * np.linalg.norm(d32))
    assert cosine > 0.95, cosine


def test_nonfinite_gradients_skip_the_update_and_are_reported():
    tx = optax.sgd(0.05)
    state = make_state(tx, tx)
    batch = scored_batch(state)
    poisoned = batch.replace(rewards=batch.rewards.at[3].set(jnp.nan))
    new, metrics = jax.jit(functools.partial(ppo_step, config=PPOConfig()))(state, poisoned)
    assert float(metrics["nonfinite_inputs"]) == 1.0
    assert float(metrics["policy/skipped_nonfinite"]) == 1.0 and float(metrics["critic/skipped_nonfinite"]) == 1.0
    for a, b in zip(jax.tree.leaves((new.policy, new.critic)), jax.tree.leaves((state.policy, state.critic))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the host-side check names the sample before it gets that far
    with pytest.raises(BatchError, match="rewards are NaN or inf at sample 3"):
        validate_batch(poisoned)


def test_bad_batches_are_named():
    batch = rollout_batch()
    validate_batch(batch, vocab_size=TINY.vocab_size)
    with pytest.raises(BatchError, match=r"logp_infer is NaN or inf on response tokens of samples 2, 5"):
        validate_batch(batch.replace(logp_infer=batch.logp_infer.at[2, 4].set(jnp.inf).at[5, 4].set(jnp.nan)))
    with pytest.raises(BatchError, match="response_mask has shape"):
        validate_batch(batch.replace(response_mask=batch.response_mask[:, :-1]))
    with pytest.raises(BatchError, match="rewards must be one per sample"):
        validate_batch(batch.replace(rewards=batch.rewards[:-1]))
    with pytest.raises(BatchError, match=r"outside the vocabulary \[0, 64\) at sample 0"):
        validate_batch(batch.replace(tokens=batch.tokens.at[0, 0].set(64)), vocab_size=64)
    with pytest.raises(BatchError, match="positive log-probabilities on response tokens of sample 7"):
        validate_batch(batch.replace(logp_infer=batch.logp_infer.at[7, 5].set(0.5)))
    with pytest.raises(BatchError, match="run score_batch"):
        validate_batch(batch, need_old=True)
    with pytest.raises(BatchError, match="response_mask is 1 outside attention_mask at sample 0"):
        validate_batch(batch.replace(attention_mask=batch.attention_mask.at[0, 5].set(0)))


def test_bad_configs_and_shapes_are_named():
    with pytest.raises(ValueError, match="minibatches must be >= 1"):
        UpdateConfig(minibatches=0)
    with pytest.raises(ValueError, match="unknown loss_agg 'sum'"):
        SurrogateConfig(loss_agg="sum")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        SurrogateConfig(dual_clip=0.5)
    state = make_state(optax.sgd(0.1), optax.sgd(0.1))
    batch = scored_batch(state)
    with pytest.raises(ValueError, match="batch of 16 samples does not split into 3 mini-batches x 1 micro-batches"):
        ppo_step(state, batch, config=PPOConfig(update=UpdateConfig(minibatches=3)))
    with pytest.raises(ValueError, match="run score_batch first"):
        ppo_step(state, rollout_batch(), config=PPOConfig())
    with pytest.raises(ValueError, match="logp_ref is missing"):
        ppo_step(state, batch, config=PPOConfig(kl=KLConfig(coef=0.1)))
    with pytest.raises(AssertionError, match=r"\(16, 11\).*logp_old, logp_infer and mask must share one"):
        ppo_step(state, batch.replace(logp_old=batch.logp_old[:, :-1]), config=PPOConfig())


def test_grpo_uses_the_group_baseline_and_leaves_the_critic_alone():
    lr = 0.05
    config = PPOConfig(advantage="grpo", surrogate=NO_CORRECTION)
    state = make_state(optax.sgd(lr), optax.sgd(lr))
    batch = scored_batch(state)
    new, metrics = jax.jit(functools.partial(ppo_step, config=config, group_size=4))(state, batch)
    assert not any(k.startswith("critic/") for k in metrics)
    for a, b in zip(jax.tree.leaves(new.critic), jax.tree.leaves(state.critic)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # reference: A = (R − group mean) / (group std + eps) on every response token
    r = host(batch.rewards).reshape(-1, 4)
    group = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    m = host(batch.response_mask)
    np.testing.assert_allclose(float(metrics["advantage_mean"]), (group[:, None] * m).sum() / m.sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="not a whole number of groups of 5"):
        ppo_step(state, batch, config=PPOConfig(advantage="grpo"), group_size=5)


@pytest.mark.parametrize("advantage, kind", [("rloo", "ppo"), ("reinforce++", "cispo"), ("grpo", "gspo")])
def test_the_critic_free_baselines_and_loss_kinds_train_the_policy_through_the_step(advantage, kind):
    """Each baseline and policy-loss kind through the whole step: the advantages it trains on are
    the core function's (RLOO against NumPy), the critic is untouched, and the policy moves as
    an SGD step on the loss of `policy_loss` with those advantages."""
    from opd_jax.core import advantages_and_returns, policy_loss, sequence_logprobs

    lr = 0.05
    config = PPOConfig(advantage=advantage, surrogate=SurrogateConfig(kind=kind, mismatch=MismatchCorrection("none")))
    state = make_state(optax.sgd(lr), optax.sgd(lr))
    batch = scored_batch(state)
    new, metrics = jax.jit(functools.partial(ppo_step, config=config, group_size=4))(state, batch)
    for a, b in zip(jax.tree.leaves(new.critic), jax.tree.leaves(state.critic)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    advantages, _ = advantages_and_returns(batch, config=config, group_size=4)
    m = host(batch.response_mask)
    if advantage == "rloo":
        r = host(batch.rewards).reshape(-1, 4)
        rloo = (r - (r.sum(1, keepdims=True) - r) / 3).reshape(-1)
        np.testing.assert_allclose(host(advantages), rloo[:, None] * m, atol=1e-5)

    def loss(params):
        logp, _ = sequence_logprobs(state.policy_def, params, batch)
        return policy_loss(logp, batch.logp_old, advantages, batch.response_mask, kind=kind)[0]
    grads = jax.grad(loss)(state.policy)
    expected = jax.tree.map(lambda p, g: p - lr * g, state.policy, grads)
    assert_updates_close(new.policy, expected, state.policy)
    assert np.isfinite(float(metrics["policy/loss"]))


@pytest.mark.parametrize("kind", ["tis", "seq-mis"])  # every kind: test_core_mismatch
def test_minus_inf_engine_logprobs_off_the_mask_leave_the_step_unchanged(kind):
    """validate_batch accepts −inf engine log-probs outside the response mask (nothing was
    sampled there); the step must select, not multiply, so the update is the clean batch's and
    is not skipped (a NaN loss would skip every update and training would silently stop)."""
    state = make_state(optax.sgd(0.05), optax.sgd(0.05))
    batch = scored_batch(state)
    dirty = batch.replace(logp_infer=jnp.where(batch.response_mask > 0, batch.logp_infer, -jnp.inf))
    validate_batch(dirty)
    step = jax.jit(functools.partial(ppo_step, config=PPOConfig(
        surrogate=SurrogateConfig(mismatch=MismatchCorrection(kind, hi=1.5 if kind != "geo-reject" else 1.2)))))
    clean_state, clean = step(state, batch)
    dirty_state, metrics = step(state, dirty)
    assert float(metrics["policy/skipped_nonfinite"]) == 0.0 and np.isfinite(float(metrics["policy/loss"]))
    assert float(metrics["policy/weight_zero_frac"]) < 1.0
    for a, b in zip(jax.tree.leaves(dirty_state.policy), jax.tree.leaves(clean_state.policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name, value in clean.items():
        np.testing.assert_array_equal(float(metrics[name]), float(value), err_msg=name)


def test_a_kl_run_scores_against_the_frozen_reference():
    """PPOState.create(reference=True) holds a copy of the policy that score_batch scores each
    batch with (logp_ref) and the step never trains: after one step the policy's log-probs moved,
    the reference's are the first step's θ_old log-probs still."""
    policy, critic = tiny_models()
    state = PPOState.create(policy, critic, optax.sgd(0.5), optax.sgd(0.5), reference=True)
    batch = scored_batch(state)
    np.testing.assert_array_equal(np.asarray(batch.logp_ref), np.asarray(batch.logp_old))
    config = PPOConfig(kl=KLConfig(coef=0.1, kind="k3", where="loss"))
    new, metrics = jax.jit(functools.partial(ppo_step, config=config))(state, batch)
    assert float(metrics["policy/kl_loss"]) < 1e-9  # the one update starts at the reference
    for x, y in zip(jax.tree.leaves(new.reference), jax.tree.leaves(state.reference)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    again = score_batch(new, rollout_batch())
    np.testing.assert_allclose(np.asarray(again.logp_ref), np.asarray(batch.logp_old), atol=1e-6)
    assert np.abs(np.asarray(again.logp_old - again.logp_ref)).max() > 1e-3
    # without a KL term nothing of a reference is held or scored
    assert score_batch(make_state(optax.sgd(0.1), optax.sgd(0.1)), rollout_batch()).logp_ref is None
