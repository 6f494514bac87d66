"""Registered algorithm parts: the registry (built-in names, a user's by import path), runs
without a critic, and the three algorithms added through it (DeepSeek-V3.2's off-policy
sequence masking, DAPO's dynamic sampling and overlong reward shaping), each against NumPy
written from its formula and, where it enters the step, through the whole step against a hand
SGD step."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ppo_setup import assert_updates_close, make_state, scored_batch, tiny_models

from opd_jax.core import (
    ADVANTAGE_ESTIMATORS,
    MismatchCorrection,
    PPOConfig,
    PPOState,
    SurrogateConfig,
    advantages_and_returns,
    policy_loss,
    ppo_step,
    score_batch,
    sequence_logprobs,
)
from opd_jax.core.algorithms.dynamic_sampling import informative_groups
from opd_jax.core.algorithms.offpolicy_mask import offpolicy_sequence_mask
from opd_jax.core.algorithms.overlong import overlong_penalty


def host(x):
    return np.asarray(x, np.float64)


def critic_free_state(lr=0.05):
    policy, _ = tiny_models()
    return PPOState.create(policy, None, optax.sgd(lr), None)


def sgd_on(state, loss, lr):
    grads = jax.grad(loss)(state.policy)
    return jax.tree.map(lambda p, g: p - lr * g, state.policy, grads)


# --- the registry ----------------------------------------------------------------------------

def test_unknown_names_and_bad_import_paths_are_named():
    with pytest.raises(ValueError, match="advantage: unknown advantage estimator 'gea'; choose one of gae, grpo"):
        PPOConfig(advantage="gea")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        PPOConfig(advantage="no_such_module:fn")
    with pytest.raises(ValueError, match="has no callable 'nothing'"):
        PPOConfig(advantage="user_algorithms:nothing")
    with pytest.raises(ValueError, match="does not take parameters"):
        PPOConfig(advantage="user_algorithms:scaled_grpo", advantage_params={"scael": 2.0})
    with pytest.raises(ValueError, match="kind: unknown policy loss 'ppoo'"):
        SurrogateConfig(kind="ppoo")
    with pytest.raises(ValueError, match="unknown needs"):
        ADVANTAGE_ESTIMATORS.register("x", needs=("critc",))


def test_a_user_estimator_by_import_path_trains_without_a_critic():
    """The estimator's advantages are the ones the step trains on (an SGD step on policy_loss
    with them), and it builds no critic: the state has none, nothing is scored for it."""
    lr = 0.05
    config = PPOConfig(advantage="user_algorithms:scaled_grpo", advantage_params={"scale": 2.0},
                       surrogate=SurrogateConfig(mismatch=MismatchCorrection("none")))
    assert not config.uses_critic
    state = critic_free_state(lr)
    batch = scored_batch(state)
    assert batch.old_values is None and batch.end_values is None
    advantages, returns = advantages_and_returns(batch, config=config, group_size=4)
    r = host(batch.rewards).reshape(-1, 4)
    expected = 2.0 * (r - r.mean(1, keepdims=True)).reshape(-1)[:, None] * host(batch.response_mask)
    np.testing.assert_allclose(host(advantages), expected, atol=1e-5)
    assert returns is None
    new, metrics = jax.jit(functools.partial(ppo_step, config=config, group_size=4))(state, batch)

    def loss(params):
        logp, _ = sequence_logprobs(state.policy_def, params, batch)
        return policy_loss(logp, batch.logp_old, advantages, batch.response_mask)[0]
    assert_updates_close(new.policy, sgd_on(state, loss, lr), state.policy)
    assert new.critic is None and new.critic_opt is None
    assert not any(k.startswith("critic/") or k.startswith("value_") for k in metrics)


def test_a_user_estimator_that_needs_the_critic_gets_its_values_and_a_user_loss_is_used():
    lr = 0.05
    config = PPOConfig(advantage="user_algorithms:one_step_td",
                       surrogate=SurrogateConfig(kind="user_algorithms:reinforce_loss",
                                                 mismatch=MismatchCorrection("none")))
    assert config.uses_critic
    state = make_state(optax.sgd(lr), optax.sgd(lr))
    batch = scored_batch(state)
    advantages, returns = advantages_and_returns(batch, config=config)
    m, v = host(batch.response_mask), host(batch.old_values)
    rewards = np.zeros_like(m)
    for i in range(len(m)):
        if m[i].sum():
            rewards[i, np.flatnonzero(m[i])[-1]] = float(batch.rewards[i])
    next_v = np.concatenate([v[:, 1:] * m[:, 1:], np.zeros_like(v[:, :1])], 1)
    np.testing.assert_allclose(host(advantages), (rewards + next_v - v) * m, atol=1e-5)
    new, metrics = jax.jit(functools.partial(ppo_step, config=config))(state, batch)
    assert "critic/loss" in metrics  # the critic trains

    def loss(params):
        logp, _ = sequence_logprobs(state.policy_def, params, batch)
        return jnp.sum(-jnp.asarray(advantages) * logp * m) / m.sum()
    assert_updates_close(new.policy, sgd_on(state, loss, lr), state.policy)


def test_a_critic_free_state_holds_and_scores_no_critic():
    policy, critic = tiny_models()
    with_critic = PPOState.create(policy, critic, optax.adam(1e-3), optax.adam(1e-3))
    without = PPOState.create(policy, None, optax.adam(1e-3), None)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    # the critic's weights, Adam's two moments of them and Adam's step count: none of it held
    assert count(with_critic) - count(without) == 3 * count(with_critic.critic) + 1
    scored = score_batch(without, scored_batch(with_critic))
    np.testing.assert_array_equal(np.asarray(scored.logp_old),
                                  np.asarray(score_batch(with_critic, scored).logp_old))
    with pytest.raises(ValueError, match="needs a critic, and the state has none"):
        ppo_step(without, scored, config=PPOConfig())


# --- DeepSeek-V3.2's off-policy sequence masking ---------------------------------------------

def numpy_offpolicy_mask(logp_policy, logp_infer, advantages, m, delta):
    n = np.maximum(m.sum(1), 1)
    divergence = ((logp_infer - logp_policy) * m).sum(1) / n
    advantage = (advantages * m).sum(1) / n
    masked = (advantage < 0) & (divergence > delta)
    return np.where(masked[:, None], 0.0, 1.0) * np.ones_like(m)


def test_offpolicy_mask_matches_numpy():
    rng = np.random.default_rng(0)
    B, T = 16, 9
    m = (rng.uniform(size=(B, T)) < 0.8).astype(np.float32)
    logp_infer = -rng.uniform(0.1, 3, (B, T)).astype(np.float32)
    logp_policy = (logp_infer + rng.normal(scale=0.4, size=(B, T))).astype(np.float32)
    advantages = rng.normal(size=(B, 1)).repeat(T, 1).astype(np.float32)
    on = m > 0
    log_k = np.where(on, logp_policy - logp_infer, 0.0)
    ours = np.asarray(offpolicy_sequence_mask(jnp.asarray(log_k), jnp.asarray(on), jnp.asarray(advantages), 0.1))
    expected = numpy_offpolicy_mask(logp_policy, logp_infer, advantages, m, 0.1)
    np.testing.assert_array_equal(ours, expected)
    assert 0 < (expected[:, 0] == 0).sum() < B  # some sequences masked, not all


def test_offpolicy_mask_through_the_step_equals_a_hand_sgd_step():
    """GRPO with off-policy sequence masking: at the first update the policy is θ_old, so each
    sequence's mask is from mean(logp_infer − logp_old) and its group advantage; the step equals
    one SGD step on the clipped surrogate with those weights."""
    lr, delta = 0.05, 0.05
    config = PPOConfig(advantage="grpo", surrogate=SurrogateConfig(
        mismatch=MismatchCorrection("offpolicy-mask", params={"delta": delta})))
    state = critic_free_state(lr)
    batch = scored_batch(state, noise=0.4)
    m = host(batch.response_mask)
    r = host(batch.rewards).reshape(-1, 4)
    group = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    adv = group[:, None] * m
    w = numpy_offpolicy_mask(host(batch.logp_old), host(batch.logp_infer), adv, m, delta)
    assert (w[:, 0] == 0).sum() > 0
    new, metrics = jax.jit(functools.partial(ppo_step, config=config, group_size=4))(state, batch)

    def loss(params):
        logp, _ = sequence_logprobs(state.policy_def, params, batch)
        ratio = jnp.exp(logp - batch.logp_old)
        A = jnp.asarray(adv, jnp.float32)
        per = -jnp.asarray(w, jnp.float32) * jnp.minimum(ratio * A, jnp.clip(ratio, 0.8, 1.28) * A)
        return jnp.sum(per * m) / m.sum()
    assert_updates_close(new.policy, sgd_on(state, loss, lr), state.policy)
    masked_tokens = ((w == 0) & (m > 0)).sum() / m.sum()
    np.testing.assert_allclose(float(metrics["policy/weight_zero_frac"]), masked_tokens, rtol=1e-5)


# --- DAPO: overlong reward shaping and dynamic sampling ----------------------------------------

def test_overlong_penalty_matches_dapo_s_formula():
    lengths = np.arange(0, 34)
    L_max, L_cache = 32, 8
    expected = np.array([0.0 if n <= L_max - L_cache else ((L_max - L_cache) - n) / L_cache if n <= L_max else -1.0
                         for n in lengths])
    np.testing.assert_allclose(np.asarray(overlong_penalty(jnp.asarray(lengths), L_max, L_cache, 0.5)),
                               0.5 * expected, atol=1e-7)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(jnp.asarray(lengths), L_max, 40)


def test_informative_groups_are_those_whose_rewards_differ():
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, np.nan, 1, 0, 1], np.float32)
    np.testing.assert_array_equal(np.asarray(informative_groups(jnp.asarray(rewards), 4)), [False, True, False, True])


# --- through `opd-jax train` ---------------------------------------------------------------------

def test_a_user_estimator_trains_through_opd_jax_train_without_a_critic(tmp_path):
    """An estimator defined in a test module, named by import path, with dynamic sampling and
    overlong shaping on: the run trains and keeps no critic (memory.json, the summary, the
    checkpoint's tree). From the dumped trajectories: each step trains on a full batch of
    prompt groups, as many of them uninformative (all rewards equal) as the metrics say were kept
    to fill it; each reward is the verifier's 0 or 1 plus DAPO's penalty for its length."""
    from test_cli_train import run_cli
    from train_loop_settings import TINY

    from opd_jax.run_files import checkpoint_steps

    result = run_cli(["train", *TINY, "steps=2", f"logging.run_dir={tmp_path}", "logging.eval_every=2",
                      "algorithm.ppo.advantage=user_algorithms:scaled_grpo", "algorithm.ppo.advantage_params={scale: 2}",
                      "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_rounds=2", "rollout.overlong_buffer=4",
                      "rollout.overlong_penalty=0.5", "logging.dump_rollouts=true",
                      "algorithm.policy_optimizer.learning_rate=1e-3"])
    assert result.exit_code == 0, result.output
    assert "no critic (the estimator needs none)" in result.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    for row in steps:
        assert row["rollout/dynamic_draw_rounds"] in (1.0, 2.0)
        assert "critic/loss" not in row and "value_mean" not in row and np.isfinite(row["policy/loss"])
        dumped = [json.loads(line) for line in
                  (tmp_path / "rollouts" / f"step_{row['step']:06d}.jsonl").read_text().splitlines()]
        assert len(dumped) == 4 * 4  # data.prompts_per_step groups of rollout.samples_per_prompt: the batch holds
        lengths = np.array([len(d["token_ids"]) - d["prompt_len"] for d in dumped])
        rewards = np.array([d["reward"] for d in dumped])
        verifier = rewards + 0.5 * lengths / 4  # max_new_tokens 4 = the buffer: R_length = −length / 4
        np.testing.assert_allclose(verifier, np.round(verifier), atol=1e-5)
        assert set(np.round(verifier)) <= {0.0, 1.0}
        groups = verifier.reshape(4, 4)
        uninformative = int(np.sum(np.ptp(rewards.reshape(4, 4), axis=1) <= 1e-6))
        assert uninformative == row["rollout/dynamic_uninformative_groups"], (groups, row)
        if row["rollout/dynamic_draw_rounds"] == 1.0:
            assert uninformative == 0 and row["rollout/dynamic_dropped_groups"] == 0
        # the advantages dumped are the ones the step trained on: scaled_grpo (scale 2) from the
        # rewards, written from its formula here, on every loss-mask token, 0 elsewhere
        expected = 2 * (rewards.reshape(4, 4) - rewards.reshape(4, 4).mean(axis=1, keepdims=True)).reshape(-1)
        for d, a in zip(dumped, expected):
            mask = np.asarray(d["loss_mask"])
            np.testing.assert_allclose(np.asarray(d["advantages"])[mask == 1], a, rtol=1e-6, atol=1e-6)
            assert np.all(np.asarray(d["advantages"])[mask == 0] == 0)
        assert "targets/advantages" not in row
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["critic"] is False and memory["critic_gib"] == 0.0
    assert checkpoint_steps(tmp_path)[-1] == 2
    recorded = json.loads((tmp_path / "checkpoints" / "2" / "meta" / "metadata").read_text())["tree"]
    assert any(leaf.startswith(".policy[") for leaf in recorded)
    assert not any("critic" in leaf for leaf in recorded), [leaf for leaf in recorded if "critic" in leaf]
