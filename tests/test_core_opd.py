"""The OPD signals against NumPy written from the formulas, on ragged batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.core import full_reverse_kl, opd_advantages, reverse_kl_advantage, top_k_reverse_kl


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


def test_sampled_advantage_is_minus_the_reverse_kl_in_expectation():
    _, _, s, t = batch(1)
    ls, lt = log_softmax(s), log_softmax(t)
    expectation = np.sum(np.exp(ls) * (lt - ls), axis=-1)  # E_{y~π_s}[log π_t(y) − log π_s(y)]
    np.testing.assert_allclose(-np.asarray(full_reverse_kl(s, t)), expectation, atol=1e-5)


def test_full_reverse_kl_value_and_student_gradient():
    _, _, s, t = batch(2)
    ls, lt = log_softmax(s), log_softmax(t)
    np.testing.assert_allclose(full_reverse_kl(s, t), np.sum(np.exp(ls) * (ls - lt), -1), atol=1e-5)
    assert np.allclose(full_reverse_kl(s, s), 0.0, atol=1e-6)
    g_teacher = jax.grad(lambda t_: jnp.sum(full_reverse_kl(jnp.asarray(s), t_)))(jnp.asarray(t))
    assert not np.any(g_teacher)
    # d KL / d s_v = p_v · ((ls_v − lt_v) − KL)
    g = jax.grad(lambda s_: jnp.sum(full_reverse_kl(s_, jnp.asarray(t))))(jnp.asarray(s))
    kl = np.sum(np.exp(ls) * (ls - lt), -1, keepdims=True)
    np.testing.assert_allclose(g, np.exp(ls) * ((ls - lt) - kl), atol=1e-5)


def test_top_k_reverse_kl_renormalises_on_the_teachers_support():
    _, _, s, t = batch(3)
    K = 4
    lt_full = log_softmax(t)
    ids = np.argsort(-lt_full, axis=-1)[..., :K]
    lt_top = np.take_along_axis(lt_full, ids, -1)
    ls_top = np.take_along_axis(log_softmax(s), ids, -1)
    ps = np.exp(ls_top) / np.exp(ls_top).sum(-1, keepdims=True)
    pt = np.exp(lt_top) / np.exp(lt_top).sum(-1, keepdims=True)
    expected = np.sum(ps * (np.log(ps) - np.log(pt)), -1)
    np.testing.assert_allclose(top_k_reverse_kl(s, lt_top, ids), expected, atol=1e-5)
    # with the whole vocabulary as the support it is the full reverse KL
    all_ids = np.broadcast_to(np.arange(t.shape[-1]), t.shape)
    np.testing.assert_allclose(top_k_reverse_kl(s, lt_full, all_ids), full_reverse_kl(s, t), atol=1e-5)
