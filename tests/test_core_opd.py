"""The OPD signals against NumPy written from the formulas, on ragged batches: the sampled
advantage, every divergence and its gradient in the student, on the full vocabulary and on the
teacher's top-k; domain balancing on fixed numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.core import (
    DIVERGENCES,
    balance_weights,
    divergence,
    full_support,
    opd_advantages,
    reverse_kl_advantage,
    running_divergence,
    top_k_support,
)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def batch(seed=0, B=4, T=7, V=11):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    return rng, mask, rng.normal(size=(B, T, V)).astype(np.float32), rng.normal(size=(B, T, V)).astype(np.float32)


def test_reverse_kl_advantage_and_reward_mixing():
    rng, mask, _, _ = batch()
    lt, ls, reward = (rng.normal(size=mask.shape).astype(np.float32) for _ in range(3))
    expected = np.where(mask > 0, lt - ls, 0.0)
    np.testing.assert_allclose(reverse_kl_advantage(lt, ls, mask), expected, atol=1e-6)
    np.testing.assert_allclose(opd_advantages(lt, ls, mask, reward, alpha=0.5),
                               expected + 0.5 * np.where(mask > 0, reward, 0.0), atol=1e-6)
    with pytest.raises(ValueError, match="reward_advantages"):
        opd_advantages(lt, ls, mask, alpha=1.0)
    # stop-gradient: the advantage is a constant of the student's log-probs
    grad = jax.grad(lambda s: jnp.sum(reverse_kl_advantage(jnp.asarray(lt), s, jnp.asarray(mask))))(jnp.asarray(ls))
    assert not np.any(grad)


def kl(p, q):
    return np.sum(p * (np.log(p) - np.log(q)), -1)


def reference(ls, lt, kind, beta=0.5, alpha=0.1):
    """The divergences in NumPy, from the formulas (s the student, t the teacher)."""
    s, t = np.exp(ls.astype(np.float64)), np.exp(lt.astype(np.float64))
    if kind == "reverse_kl":
        return kl(s, t)
    if kind == "forward_kl":
        return kl(t, s)
    if kind == "jsd":
        m = beta * t + (1 - beta) * s
        return beta * kl(t, m) + (1 - beta) * kl(s, m)
    if kind == "skew_forward_kl":
        return kl(t, alpha * s + (1 - alpha) * t)
    return kl(s, alpha * t + (1 - alpha) * s)


def full(s, t, kind, **kw):
    return divergence(*full_support(jnp.asarray(s), jnp.asarray(t)), kind, **kw)


def test_sampled_advantage_is_minus_the_reverse_kl_in_expectation():
    _, _, s, t = batch(1)
    ls, lt = log_softmax(s), log_softmax(t)
    expectation = np.sum(np.exp(ls) * (lt - ls), axis=-1)  # E_{y~π_s}[log π_t(y) − log π_s(y)]
    np.testing.assert_allclose(-np.asarray(full(s, t, "reverse_kl")), expectation, atol=1e-5)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_each_divergence_and_its_student_gradient(kind):
    _, _, s, t = batch(2)
    ls, lt = log_softmax(s), log_softmax(t)
    kw = {"jsd_beta": 0.3, "skew_alpha": 0.2}
    expected = reference(ls, lt, kind, beta=0.3, alpha=0.2)
    np.testing.assert_allclose(full(s, t, kind, **kw), expected, rtol=1e-4, atol=1e-5)
    assert np.allclose(full(s, s, kind, **kw), 0.0, atol=1e-5)  # zero at the teacher
    g_teacher = jax.grad(lambda t_: jnp.sum(full(s, t_, kind, **kw)))(jnp.asarray(t))
    assert not np.any(g_teacher)  # the teacher is a constant
    # the student's gradient by central differences of the NumPy reference, in float64
    g = np.asarray(jax.grad(lambda s_: jnp.sum(full(s_, t, kind, **kw)))(jnp.asarray(s)))
    s64, h = s.astype(np.float64), 1e-5
    for index in [(0, 0, 0), (1, 3, 5), (3, 6, 10)]:
        up, down = s64.copy(), s64.copy()
        up[index] += h
        down[index] -= h
        numeric = (reference(log_softmax(up), lt, kind, 0.3, 0.2)[index[:2]]
                   - reference(log_softmax(down), lt, kind, 0.3, 0.2)[index[:2]]) / (2 * h)
        np.testing.assert_allclose(g[index], numeric, rtol=2e-3, atol=2e-5)


def test_reverse_kl_gradient_in_closed_form():
    _, _, s, t = batch(2)
    ls, lt = log_softmax(s), log_softmax(t)
    # d KL / d s_v = p_v · ((ls_v − lt_v) − KL)
    g = jax.grad(lambda s_: jnp.sum(full(s_, t, "reverse_kl")))(jnp.asarray(s))
    np.testing.assert_allclose(g, np.exp(ls) * ((ls - lt) - kl(np.exp(ls), np.exp(lt))[..., None]), atol=1e-5)


def test_jsd_reaches_the_forward_and_reverse_kl_at_its_ends():
    """GKD: JSD(β)/β → KL(t ‖ s) as β → 0 and JSD(β)/(1 − β) → KL(s ‖ t) as β → 1; between
    them it stays below H(β) (log 2 at ½); skew KL at α = 1 is the plain KL."""
    _, _, s, t = batch(4)
    forward, reverse = full(s, t, "forward_kl"), full(s, t, "reverse_kl")
    np.testing.assert_allclose(full(s, t, "jsd", jsd_beta=1e-4) / 1e-4, forward, rtol=2e-3, atol=1e-3)
    np.testing.assert_allclose(full(s, t, "jsd", jsd_beta=1 - 1e-4) / 1e-4, reverse, rtol=2e-3, atol=1e-3)
    assert np.all(np.asarray(full(s, 3 * t, "jsd")) <= np.log(2) + 1e-6)
    np.testing.assert_allclose(full(s, t, "skew_forward_kl", skew_alpha=1.0), forward, atol=1e-6)
    np.testing.assert_allclose(full(s, t, "skew_reverse_kl", skew_alpha=1.0), reverse, atol=1e-6)
    with pytest.raises(ValueError, match="jsd_beta must be in"):
        full(s, t, "jsd", jsd_beta=0.0)
    with pytest.raises(ValueError, match="unknown divergence 'tv'"):
        full(s, t, "tv")


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_top_k_renormalises_on_the_teachers_support(kind):
    _, _, s, t = batch(3)
    K = 4
    lt_full = log_softmax(t)
    ids = np.argsort(-lt_full, axis=-1)[..., :K]
    lt_top = np.take_along_axis(lt_full, ids, -1)
    ls_top = np.take_along_axis(log_softmax(s), ids, -1)
    expected = reference(log_softmax(ls_top), log_softmax(lt_top), kind)
    got = divergence(*top_k_support(jnp.asarray(s), jnp.asarray(lt_top), jnp.asarray(ids)), kind)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # with the whole vocabulary as the support it is the full divergence
    all_ids = np.broadcast_to(np.arange(t.shape[-1]), t.shape)
    np.testing.assert_allclose(divergence(*top_k_support(jnp.asarray(s), jnp.asarray(lt_full), jnp.asarray(all_ids)), kind),
                               full(s, t, kind), rtol=1e-4, atol=1e-5)


def test_a_domain_whose_divergence_stays_high_gets_more_weight():
    """Fixed numbers through the documented rule: u_k = max(d⁺_k / mean d⁺, floor), w = u / mean u."""
    running = np.array([0.1, 0.4, np.nan, -0.05], np.float32)  # teacher 2 not seen yet, teacher 3's estimate < 0
    # d⁺ = [0.1, 0.4, 0.5/3 (the seen ones' mean), 0]; mean 1/6; u = [0.6, 2.4, 1.0, 0.25]; mean u 1.0625
    np.testing.assert_allclose(balance_weights(running, floor=0.25), np.array([0.6, 2.4, 1.0, 0.25]) / 1.0625, rtol=1e-6)
    np.testing.assert_allclose(balance_weights(np.full(3, 0.2, np.float32), 0.25), np.ones(3), rtol=1e-6)
    np.testing.assert_allclose(balance_weights(np.zeros(3, np.float32), 0.25), np.ones(3))  # nothing to balance
    # the running value: an EMA over the steps that had the teacher's rows
    r = np.array([np.nan, 1.0, 1.0], np.float32)
    r = running_divergence(r, np.array([0.5, 0.2, 9.0], np.float32), np.array([True, True, False]), decay=0.75)
    np.testing.assert_allclose(r, [0.5, 0.75 * 1.0 + 0.25 * 0.2, 1.0], rtol=1e-6)
    # the others learnt (their divergence falls 0.6 -> 0.05), one held at 0.6: its weight grows
    # step after step, theirs shrink to the floor's share
    r = np.full(3, np.nan, np.float32)
    weights = []
    for step in range(30):
        easy = max(0.6 - 0.05 * step, 0.05)
        r = running_divergence(r, np.array([easy, easy, 0.6], np.float32), np.ones(3, bool), decay=0.9)
        weights.append(np.asarray(balance_weights(r, floor=0.25)))
    held = [w[2] for w in weights]
    assert held[0] == 1.0 and all(b >= a for a, b in zip(held, held[1:])) and held[-1] > 2.0, held
    assert weights[-1][0] == weights[-1][1] < 0.4
    with pytest.raises(ValueError, match="floor must be in"):
        balance_weights(r, floor=0.0)
