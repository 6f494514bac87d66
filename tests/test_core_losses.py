"""The pure PPO / IcePop functions against NumPy written from the formulas, on ragged batches."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_jax.core import (
    gae,
    group_advantages,
    icepop_weights,
    kl_estimate,
    length_adaptive_lambda,
    loss_denominator,
    outcome_rewards,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    shift_right,
    tis_weights,
    token_logprobs,
    value_loss,
    whiten,
)


def ragged_mask(rng, B, T, holes=False):
    mask = np.zeros((B, T), np.float32)
    for i in range(B):
        start, n = rng.integers(0, 3), rng.integers(0, T - 2)  # includes all-masked rows (n = 0)
        mask[i, start:start + n] = 1
        if holes and n > 4:
            mask[i, start + 2] = 0
    mask[0] = 0
    return mask


def numpy_gae(r, v, m, gamma, lam):
    B, T = r.shape
    adv = np.zeros((B, T))
    for i in range(B):
        next_v, next_a = 0.0, 0.0
        for t in reversed(range(T)):
            a = r[i, t] + gamma * next_v - v[i, t] + gamma * lam * next_a
            if m[i, t]:
                adv[i, t], next_v, next_a = a, v[i, t], a
    return adv * m, (adv + v) * m


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_numpy(gamma, lam, holes):
    rng = np.random.default_rng(int(gamma * 100 + lam * 10))
    B, T = 6, 13
    m = ragged_mask(rng, B, T, holes)
    r = rng.normal(size=(B, T)).astype(np.float32) * m
    v = rng.normal(size=(B, T)).astype(np.float32)
    adv, ret = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma, lam)
    ref_adv, ref_ret = numpy_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, atol=1e-5)


def test_gae_outcome_reward_with_lambda_one_is_reward_minus_value():
    """γ = λ = 1, reward only on the last token: A_t = R − V_t, returns = R on every token."""
    m = np.array([[1, 1, 1, 1, 0, 0]], np.float32)
    r = np.array([[0, 0, 0, 2.5, 0, 0]], np.float32)
    v = np.array([[0.3, -1.0, 0.7, 2.0, 9.0, 9.0]], np.float32)
    adv, ret = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), 1.0, 1.0)
    np.testing.assert_allclose(adv, (2.5 - v) * m, atol=1e-6)
    np.testing.assert_allclose(ret, 2.5 * m, atol=1e-6)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_match_numpy(normalize_std):
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0.2, 0.7, 0.1, 0.0], np.float32)
    ours = np.asarray(group_advantages(jnp.asarray(rewards), 4, normalize_std=normalize_std))
    g = rewards.reshape(3, 4)
    ref = g - g.mean(1, keepdims=True)
    if normalize_std:
        ref = ref / (g.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(ours, ref.reshape(-1), atol=1e-5)
    np.testing.assert_array_equal(ours[4:8], 0.0)  # all-equal group: no signal, no NaN
    with pytest.raises(ValueError, match="not a multiple of group_size=5"):
        group_advantages(jnp.asarray(rewards), 5)


def test_icepop_and_tis_match_numpy_with_bounds_hit_exactly():
    rng = np.random.default_rng(5)
    logp_infer = -rng.uniform(0.1, 4, (4, 64)).astype(np.float32)
    logp_old = (logp_infer + rng.normal(scale=1.0, size=(4, 64))).astype(np.float32)
    k = np.exp(logp_old.astype(np.float64) - logp_infer)
    ALL = jnp.ones((4, 64))
    ours = np.asarray(icepop_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), ALL, hi=2.0))
    np.testing.assert_allclose(ours, np.where((k >= 0.5) & (k <= 2.0), k, 0.0), rtol=1e-5)
    assert 0 < (ours == 0).mean() < 1
    ours = np.asarray(icepop_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), ALL, hi=3.0, lo=0.8))
    np.testing.assert_allclose(ours, np.where((k >= 0.8) & (k <= 3.0), k, 0.0), rtol=1e-5)
    # bounds are inclusive: k = exp(0) = 1 exactly, with the band [1, 1]
    same = jnp.asarray(logp_infer)
    np.testing.assert_array_equal(np.asarray(icepop_weights(same, same, ALL, hi=1.0, lo=1.0)), 1.0)
    tis = np.asarray(tis_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), ALL, hi=2.0))
    np.testing.assert_allclose(tis, np.minimum(k, 2.0), rtol=1e-5)


def numpy_policy_loss(logp, logp_old, A, m, eps_low, eps_high, dual_clip, w, agg):
    r = np.exp(logp.astype(np.float64) - logp_old)
    l = -w * np.minimum(r * A, np.clip(r, 1 - eps_low, 1 + eps_high) * A)  # noqa: E741
    if dual_clip is not None:
        l = np.where(A < 0, np.minimum(l, -w * dual_clip * A), l)  # noqa: E741
    if agg == "token-mean":
        return (l * m).sum() / max(m.sum(), 1)
    rows = [(l[i] * m[i]).sum() / m[i].sum() for i in range(len(m)) if m[i].sum() > 0]
    return np.mean(rows) if rows else 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("with_weights", [False, True])
def test_policy_loss_matches_numpy(agg, dual_clip, with_weights):
    rng = np.random.default_rng(zlib.crc32(repr((agg, dual_clip, with_weights)).encode()))
    B, T = 7, 11
    m = ragged_mask(rng, B, T)
    logp_old = -rng.uniform(0.1, 4, (B, T)).astype(np.float32)
    logp = (logp_old + rng.normal(scale=0.6, size=(B, T))).astype(np.float32)
    A = rng.normal(size=(B, T)).astype(np.float32) * 2
    w = rng.uniform(0, 2, (B, T)).astype(np.float32) * (rng.uniform(size=(B, T)) > 0.2) if with_weights else None
    loss, metrics = policy_loss(jnp.asarray(logp), jnp.asarray(logp_old), jnp.asarray(A), jnp.asarray(m),
                                dual_clip=dual_clip, weights=None if w is None else jnp.asarray(w), agg=agg)
    ref = numpy_policy_loss(logp, logp_old, A, m, 0.2, 0.28, dual_clip, 1.0 if w is None else w, agg)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["loss_sum"]) / max(float(metrics["token_count"]), 1), ref, rtol=1e-5,
                               atol=1e-6)
    r = np.exp(logp.astype(np.float64) - logp_old)
    n = m.sum()
    np.testing.assert_allclose(float(metrics["clip_frac_high"]), ((r > 1.28) & (A > 0) & (m > 0)).sum() / n, atol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_frac_low"]), ((r < 0.8) & (A < 0) & (m > 0)).sum() / n, atol=1e-6)
    k3 = (np.exp(-np.log(r)) - 1 + np.log(r))
    np.testing.assert_allclose(float(metrics["approx_kl_k3"]), (k3 * m).sum() / n, rtol=1e-4)


def test_ratio_one_and_unit_weights_give_minus_mean_advantage():
    rng = np.random.default_rng(0)
    m = ragged_mask(rng, 5, 9)
    logp = -rng.uniform(0.1, 3, (5, 9)).astype(np.float32)
    A = rng.normal(size=(5, 9)).astype(np.float32)
    loss, _ = policy_loss(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(A), jnp.asarray(m))
    np.testing.assert_allclose(float(loss), -(A * m).sum() / m.sum(), rtol=1e-6)


def test_micro_batch_sums_reduce_exactly_to_the_full_batch():
    rng = np.random.default_rng(1)
    m = ragged_mask(rng, 8, 10)
    logp_old = -rng.uniform(0.1, 3, (8, 10)).astype(np.float32)
    logp = logp_old + rng.normal(scale=0.3, size=(8, 10)).astype(np.float32)
    A = rng.normal(size=(8, 10)).astype(np.float32)
    full, _ = policy_loss(jnp.asarray(logp), jnp.asarray(logp_old), jnp.asarray(A), jnp.asarray(m))
    sums, counts = 0.0, 0.0
    for s in (slice(0, 3), slice(3, 8)):
        _, mt = policy_loss(jnp.asarray(logp[s]), jnp.asarray(logp_old[s]), jnp.asarray(A[s]), jnp.asarray(m[s]))
        sums, counts = sums + float(mt["loss_sum"]), counts + float(mt["token_count"])
    np.testing.assert_allclose(sums / counts, float(full), rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), beta=st.floats(1.05, 4.0))
def test_masked_and_icepop_rejected_tokens_get_exactly_zero_gradient(seed, beta):
    rng = np.random.default_rng(seed)
    B, T = 4, 8
    m = ragged_mask(rng, B, T)
    logp_old = -rng.uniform(0.1, 3, (B, T)).astype(np.float32)
    logp_infer = (logp_old + rng.normal(scale=1.0, size=(B, T))).astype(np.float32)
    logp = (logp_old + rng.normal(scale=0.1, size=(B, T))).astype(np.float32)
    A = rng.normal(size=(B, T)).astype(np.float32)
    w = icepop_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m), hi=beta)

    def loss_fn(lp):
        return policy_loss(lp, jnp.asarray(logp_old), jnp.asarray(A), jnp.asarray(m), weights=w)[0]

    grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(logp)))
    dead = (m == 0) | (np.asarray(w) == 0)
    assert np.all(grad[dead] == 0.0)
    w_grad = np.asarray(jax.grad(lambda lo: icepop_weights(lo, jnp.asarray(logp_infer), jnp.asarray(m), hi=beta).sum())(
        jnp.asarray(logp_old)))
    assert np.all(w_grad == 0.0)  # stop-gradient


def test_value_loss_matches_numpy():
    rng = np.random.default_rng(2)
    m = ragged_mask(rng, 6, 9)
    v, v_old, R = (rng.normal(size=(6, 9)).astype(np.float32) for _ in range(3))
    loss, metrics = value_loss(jnp.asarray(v), jnp.asarray(v_old), jnp.asarray(R), jnp.asarray(m), clip=0.2)
    vc = v_old + np.clip(v - v_old, -0.2, 0.2)
    per = 0.5 * np.maximum((v - R) ** 2, (vc - R) ** 2)
    np.testing.assert_allclose(float(loss), (per * m).sum() / m.sum(), rtol=1e-6)
    loss_nc, _ = value_loss(jnp.asarray(v), jnp.asarray(v_old), jnp.asarray(R), jnp.asarray(m), clip=None)
    np.testing.assert_allclose(float(loss_nc), (0.5 * (v - R) ** 2 * m).sum() / m.sum(), rtol=1e-6)
    grad = np.asarray(jax.grad(lambda x: value_loss(x, jnp.asarray(v_old), jnp.asarray(R), jnp.asarray(m))[0])(
        jnp.asarray(v)))
    assert np.all(grad[m == 0] == 0.0)


def test_all_masked_batch_is_finite():
    z = jnp.zeros((2, 4))
    loss, metrics = policy_loss(z, z, jnp.ones((2, 4)), z)
    assert float(loss) == 0.0 and all(np.isfinite(float(v)) or k == "ratio_max" for k, v in metrics.items())
    loss, _ = policy_loss(z, z, jnp.ones((2, 4)), z, agg="seq-mean-token-mean")
    assert float(loss) == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low-var"])
def test_kl_estimators_match_numpy(kind):
    rng = np.random.default_rng(7)
    logp = -rng.uniform(0.1, 3, (3, 9)).astype(np.float32)
    logp_ref = logp + rng.normal(scale=2.0, size=(3, 9)).astype(np.float32)
    logp_ref[0, 0] = logp[0, 0] + 30.0  # far enough for the low-var clamps to bite
    x = logp.astype(np.float64) - logp_ref
    ref = {"k1": x, "k2": 0.5 * x ** 2, "k3": np.exp(-x) - 1 + x,
           "low-var": np.clip(np.exp(-np.clip(x, -20, 20)) - 1 + np.clip(x, -20, 20), -10, 10)}[kind]
    np.testing.assert_allclose(np.asarray(kl_estimate(jnp.asarray(logp), jnp.asarray(logp_ref), kind)), ref,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl_estimate(jnp.asarray(logp), jnp.asarray(logp_ref), "k9")


def test_token_logprobs_and_entropy_match_numpy():
    rng = np.random.default_rng(8)
    logits = rng.normal(scale=3, size=(2, 6, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (2, 6)).astype(np.int32)
    logp, ent = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), with_entropy=True)
    z = logits.astype(np.float64)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ref_logp = np.zeros((2, 6))
    ref_ent = np.zeros((2, 6))
    for b in range(2):
        for t in range(1, 6):
            ref_logp[b, t] = logsm[b, t - 1, tokens[b, t]]
            ref_ent[b, t] = -(np.exp(logsm[b, t - 1]) * logsm[b, t - 1]).sum()
    np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(shift_right(jnp.asarray(z[..., 0]))), np.pad(z[:, :-1, 0], ((0, 0), (1, 0))))


def test_outcome_rewards_whiten_and_adaptive_lambda():
    m = np.array([[0, 1, 1, 1, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], np.float32)  # a hole, an empty row
    r = np.array([2.0, -1.0, 5.0], np.float32)
    np.testing.assert_array_equal(np.asarray(outcome_rewards(jnp.asarray(r), jnp.asarray(m))),
                                  [[0, 0, 0, 2, 0], [0, 0, 0, -1, 0], [0, 0, 0, 0, 0]])
    x = np.random.default_rng(0).normal(size=m.shape).astype(np.float32)
    sel = x[m > 0]
    ref = np.where(m > 0, (x - sel.mean()) / (sel.std() + 1e-8), 0)
    np.testing.assert_allclose(np.asarray(whiten(jnp.asarray(x), jnp.asarray(m))), ref, rtol=1e-5, atol=1e-6)
    long = np.zeros((3, 400), np.float32)
    long[0, :10], long[1, :100], long[2, :400] = 1, 1, 1
    lam = np.asarray(length_adaptive_lambda(jnp.asarray(long), alpha=0.05))
    np.testing.assert_allclose(lam, [0.0, 1 - 1 / 5, 1 - 1 / 20], rtol=1e-6)


def test_gae_takes_one_lambda_per_row():
    rng = np.random.default_rng(9)
    m = ragged_mask(rng, 4, 12, holes=True)
    r = rng.normal(size=(4, 12)).astype(np.float32) * m
    v = rng.normal(size=(4, 12)).astype(np.float32)
    lams = np.array([0.0, 0.5, 0.9, 1.0], np.float32)
    adv, ret = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), 0.97, jnp.asarray(lams))
    for i, lam in enumerate(lams):
        ref_adv, ref_ret = numpy_gae(r[i:i + 1], v[i:i + 1], m[i:i + 1], 0.97, float(lam))
        np.testing.assert_allclose(np.asarray(adv)[i:i + 1], ref_adv, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ret)[i:i + 1], ref_ret, atol=1e-5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_gradients_with_a_shared_normalizer_add_up_exactly(agg):
    rng = np.random.default_rng(10)
    m = ragged_mask(rng, 8, 10)
    logp_old = -rng.uniform(0.1, 3, (8, 10)).astype(np.float32)
    logp = jnp.asarray(logp_old + rng.normal(scale=0.3, size=(8, 10)).astype(np.float32))
    A = rng.normal(size=(8, 10)).astype(np.float32)
    args = lambda s: (jnp.asarray(logp_old[s]), jnp.asarray(A[s]), jnp.asarray(m[s]))
    full = jax.grad(lambda lp: policy_loss(lp, *args(slice(None)), agg=agg)[0])(logp)
    n = loss_denominator(jnp.asarray(m), agg)
    parts = [jax.grad(lambda lp, s=s: policy_loss(lp[s], *args(s), agg=agg, normalizer=n)[0])(logp)
             for s in (slice(0, 2), slice(2, 5), slice(5, 8))]
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(full), rtol=1e-5, atol=1e-8)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), agg=st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_property_unit_ratio_and_weights_give_minus_mean_advantage(seed, agg):
    rng = np.random.default_rng(seed)
    m = ragged_mask(rng, 5, 9)
    logp = jnp.asarray(-rng.uniform(0.1, 3, (5, 9)).astype(np.float32))
    A = rng.normal(size=(5, 9)).astype(np.float32)
    loss, metrics = policy_loss(logp, logp, jnp.asarray(A), jnp.asarray(m), weights=jnp.ones((5, 9)), agg=agg,
                                dual_clip=3.0)
    if agg == "token-mean":
        ref = -(A * m).sum() / max(m.sum(), 1)
    else:
        rows = [(A[i] * m[i]).sum() / m[i].sum() for i in range(5) if m[i].sum() > 0]
        ref = -np.mean(rows) if rows else 0.0
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
    assert float(metrics["clip_frac_low"]) == float(metrics["clip_frac_high"]) == 0.0


def test_mismatched_shapes_name_the_arrays():
    z = jnp.zeros((2, 3))
    with pytest.raises(AssertionError, match="policy_loss: logp, logp_old, advantages and mask must share"):
        policy_loss(z, z, jnp.zeros((2, 4)), z)
    with pytest.raises(AssertionError, match="value_loss: values, old_values, returns and mask must share"):
        value_loss(z, z, z, jnp.zeros((3, 3)))
    with pytest.raises(AssertionError, match="gae: rewards, values and mask must share"):
        gae(z, jnp.zeros((2, 2)), z)


def test_rloo_and_reinforce_pp_advantages_match_numpy():
    """RLOO: each sample's baseline is the mean of the other samples of its prompt; REINFORCE++-
    baseline: the group mean subtracted, then normalised over the batch's response tokens."""
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0.2, 0.7, 0.1, 0.0], np.float32)
    ours = np.asarray(rloo_advantages(jnp.asarray(rewards), 4))
    ref = [r - np.delete(g, i).mean() for g in rewards.reshape(3, 4) for i, r in enumerate(g)]
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(jnp.asarray(rewards), 1)

    rng = np.random.default_rng(3)
    m = ragged_mask(rng, 12, 9)
    ours = np.asarray(reinforce_pp_advantages(jnp.asarray(rewards), jnp.asarray(m), 4))
    centered = (rewards.reshape(3, 4) - rewards.reshape(3, 4).mean(1, keepdims=True)).reshape(-1)
    tokens = np.broadcast_to(centered[:, None], m.shape)[m > 0].astype(np.float64)
    ref = np.where(m > 0, (centered[:, None] - tokens.mean()) / (tokens.std() + 1e-8), 0.0)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def numpy_gspo_objective(logp, logp_old, A, m, eps_low, eps_high):
    """GSPO's sequence-level objective (to be maximised), float64: the mean over rows with tokens
    of min(s·A, clip(s)·A), s = exp(mean over the row's tokens of logp − logp_old)."""
    rows = []
    for i in range(len(m)):
        if m[i].sum() == 0:
            continue
        s = np.exp(((logp[i] - logp_old[i]) * m[i]).sum() / m[i].sum())
        a = A[i][m[i] > 0][0]
        rows.append(min(s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a))
    return np.mean(rows)


def test_gspo_loss_and_gradient_are_the_sequence_level_objectives():
    """GSPO's token form (seq-mean-token-mean): its value is minus the sequence-level objective,
    and its gradient with respect to the token log-probs is that objective's, by central
    differences in float64, with some sequences clipped."""
    rng = np.random.default_rng(11)
    B, T, eps_low, eps_high = 10, 8, 0.03, 0.04
    m = ragged_mask(rng, B, T)
    logp_old = -rng.uniform(0.1, 3, (B, T))
    logp = logp_old + rng.normal(scale=0.2, size=(B, T))
    A = np.broadcast_to(rng.normal(size=(B, 1)), (B, T)).copy()

    def loss(lp):
        return policy_loss(lp, jnp.asarray(logp_old, jnp.float32), jnp.asarray(A, jnp.float32), jnp.asarray(m),
                           eps_low=eps_low, eps_high=eps_high, agg="seq-mean-token-mean", kind="gspo")[0]

    ours, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(float(ours), -numpy_gspo_objective(logp, logp_old, A, m, eps_low, eps_high), rtol=1e-5)
    ref = np.zeros_like(logp)
    h = 1e-6
    for i, t in zip(*np.nonzero(m)):
        up, down = logp.copy(), logp.copy()
        up[i, t] += h
        down[i, t] -= h
        ref[i, t] = -(numpy_gspo_objective(up, logp_old, A, m, eps_low, eps_high)
                      - numpy_gspo_objective(down, logp_old, A, m, eps_low, eps_high)) / (2 * h)
    np.testing.assert_allclose(np.asarray(grad), ref, atol=1e-5)
    seq = np.array([np.exp(((logp[i] - logp_old[i]) * m[i]).sum() / m[i].sum()) for i in range(B) if m[i].sum()])
    assert ((seq < 1 - eps_low) | (seq > 1 + eps_high)).any() and ((seq > 1 - eps_low) & (seq < 1 + eps_high)).any()


def test_cispo_weights_every_token_by_its_clipped_stopped_ratio():
    """CISPO: loss = −Σ w·sg(clip(r))·A·logp / n and d loss / d logp = −w·clip(r)·A / n on every
    masked token, clipped ones included (PPO's clip would zero their gradient)."""
    rng = np.random.default_rng(4)
    B, T = 5, 9
    m = ragged_mask(rng, B, T)
    logp_old = -rng.uniform(0.1, 3, (B, T)).astype(np.float32)
    logp = (logp_old + rng.normal(scale=0.5, size=(B, T))).astype(np.float32)
    A = rng.normal(size=(B, T)).astype(np.float32)
    w = rng.uniform(0, 2, (B, T)).astype(np.float32)
    ours, grad = jax.value_and_grad(lambda lp: policy_loss(lp, jnp.asarray(logp_old), jnp.asarray(A), jnp.asarray(m),
                                                           weights=jnp.asarray(w), kind="cispo")[0])(jnp.asarray(logp))
    clipped = np.clip(np.exp(logp.astype(np.float64) - logp_old), 0.8, 1.28)
    n = m.sum()
    np.testing.assert_allclose(float(ours), -(w * clipped * A * logp * m).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), -(w * clipped * A * m) / n, rtol=1e-5, atol=1e-7)
    assert (np.abs(np.asarray(grad))[(m > 0) & (clipped != np.exp(logp - logp_old))] > 0).any()
    with pytest.raises(ValueError, match="dual_clip applies to the policy losses ppo, gspo; cispo"):
        policy_loss(jnp.asarray(logp), jnp.asarray(logp_old), jnp.asarray(A), jnp.asarray(m), kind="cispo", dual_clip=3.0)
