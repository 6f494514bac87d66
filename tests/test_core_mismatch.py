"""Every mismatch correction behind the one switch, against NumPy written from the formulas."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_jax.core import MISMATCH_CORRECTIONS, MismatchCorrection, mismatch_metrics, mismatch_weights

# the corrections weighted from θ_old before the update (offpolicy-mask weights inside the loss:
# tests/test_algorithms.py)
CORRECTION_KINDS = [n for n in MISMATCH_CORRECTIONS.names() if "current" not in MISMATCH_CORRECTIONS.get(n).needs]


def numpy_weights(logp_old, logp_infer, m, kind, hi, lo, veto):
    log_k = (logp_old.astype(np.float64) - logp_infer) * m
    k = np.exp(log_k)
    seq = log_k.sum(1, keepdims=True)
    n = np.maximum(m.sum(1, keepdims=True), 1)
    if kind == "none":
        w = np.ones_like(k)
    elif kind == "icepop":
        lo = 1 / hi if lo is None else lo
        w = np.where((k >= lo) & (k <= hi), k, 0)
    elif kind == "mis":
        lo = 0 if lo is None else lo
        w = np.where((k >= lo) & (k <= hi), k, 0)
    elif kind == "tis":
        w = np.clip(k, 0 if lo is None else lo, hi)
    elif kind == "seq-tis":
        w = np.broadcast_to(np.clip(np.exp(seq), 0 if lo is None else lo, hi), k.shape)
    elif kind == "seq-mis":
        lo = 0 if lo is None else lo
        w = np.broadcast_to(np.where((np.exp(seq) >= lo) & (np.exp(seq) <= hi), np.exp(seq), 0), k.shape)
    else:
        lo = 1 / hi if lo is None else lo
        geo = np.exp(seq / n)
        w = np.broadcast_to(((geo >= lo) & (geo <= hi)).astype(float), k.shape)
    if veto is not None:
        w = np.where(np.any((k < veto) & (m > 0), axis=1, keepdims=True), 0, w)
    return w * m


def ragged(rng, B, T):
    m = np.zeros((B, T), np.float32)
    for i in range(B):
        start = rng.integers(0, 4)
        m[i, start:start + rng.integers(0, T - start + 1)] = 1
    m[0] = 0  # an all-masked row
    return m


@pytest.mark.parametrize("kind", CORRECTION_KINDS)
@pytest.mark.parametrize("veto", [None, 1e-4])
def test_every_correction_matches_numpy(kind, veto):
    rng = np.random.default_rng(zlib.crc32(repr((kind, veto)).encode()))  # str hash() is salted per process
    B, T = 12, 10
    m = ragged(rng, B, T)
    logp_infer = -rng.uniform(0.05, 5, (B, T)).astype(np.float32)
    # mostly small mismatch, a few tokens far off, one token below the veto threshold
    logp_old = logp_infer + rng.normal(scale=0.05, size=(B, T)).astype(np.float32)
    logp_old[rng.uniform(size=(B, T)) < 0.15] -= 1.5
    logp_old[rng.uniform(size=(B, T)) < 0.15] += 1.0
    logp_old[3, 2] = logp_infer[3, 2] - 12.0
    m[3, 2] = 1
    hi = {"geo-reject": 1.05, "seq-tis": 1.5, "seq-mis": 1.2}.get(kind, 2.0)
    correction = MismatchCorrection(kind=kind, hi=hi, veto=veto)
    ours = np.asarray(mismatch_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m), correction))
    ref = numpy_weights(logp_old, logp_infer, m, kind, hi, None, veto)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=1e-7)
    if veto is not None:
        assert np.all(ours[3] == 0)
    # the data must exercise the bounds: some tokens masked (or clipped at hi), some not
    live = ours[m > 0]
    if kind in ("icepop", "mis", "seq-mis", "geo-reject"):
        assert 0 < (live == 0).mean() < 1
    elif kind in ("tis", "seq-tis"):
        assert 0 < np.isclose(live, hi).mean() < 1


def test_bounds_are_inclusive_and_explicit_lo_is_used():
    logp_infer = np.log(np.array([[0.5, 0.5, 0.5, 0.5]], np.float32))
    k = np.array([[0.5, 1.0, 2.0, 2.0001]], np.float32)
    logp_old = logp_infer + np.log(k)
    m = np.ones_like(k)
    w = np.asarray(mismatch_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m),
                                    MismatchCorrection("icepop", hi=2.0)))
    np.testing.assert_allclose(w, [[0.5, 1.0, 2.0, 0.0]], rtol=1e-5)
    w = np.asarray(mismatch_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m),
                                    MismatchCorrection("mis", hi=2.0, lo=0.9)))
    np.testing.assert_allclose(w, [[0.0, 1.0, 2.0, 0.0]], rtol=1e-5)


def test_long_sequences_do_not_overflow():
    T = 4000
    logp_infer = np.full((2, T), -3.0, np.float32)
    logp_old = logp_infer + 0.1  # ρ = e^400, far past float32
    m = np.ones((2, T), np.float32)
    for kind, expected in (("seq-tis", 2.0), ("seq-mis", 0.0)):
        w = np.asarray(mismatch_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m),
                                        MismatchCorrection(kind, hi=2.0)))
        assert np.all(np.isfinite(w)) and np.allclose(w, expected)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(CORRECTION_KINDS))
def test_weights_are_stop_gradient_and_zero_off_mask(seed, kind):
    rng = np.random.default_rng(seed)
    m = ragged(rng, 4, 6)
    lo_, li_ = (jnp.asarray(-rng.uniform(0.1, 3, (4, 6)).astype(np.float32)) for _ in range(2))
    correction = MismatchCorrection(kind)
    w = mismatch_weights(lo_, li_, jnp.asarray(m), correction)
    assert np.all(np.asarray(w)[m == 0] == 0)
    g = jax.grad(lambda a: mismatch_weights(a, li_, jnp.asarray(m), correction).sum())(lo_)
    assert np.all(np.asarray(g) == 0)


def test_bad_correction_configs_are_named():
    with pytest.raises(ValueError, match="unknown mismatch correction 'icepoop'"):
        MismatchCorrection("icepoop")
    with pytest.raises(ValueError, match="lo <= hi"):
        MismatchCorrection("tis", hi=2.0, lo=3.0)
    with pytest.raises(ValueError, match="veto"):
        MismatchCorrection("none", veto=2.0)
    with pytest.raises(ValueError, match="'none' has no lower bound"):
        MismatchCorrection("none", lo=0.5)


@pytest.mark.parametrize("kind", ["seq-tis", "seq-mis"])
def test_sequence_kinds_apply_lo(kind):
    # three rows with ρ = 0.25, 1.0, 1.5 over two tokens each
    logp_infer = np.full((3, 2), -1.0, np.float32)
    logp_old = logp_infer + np.log(np.array([[0.5, 0.5], [1.0, 1.0], [1.5, 1.0]], np.float32))
    m = np.ones((3, 2), np.float32)
    correction = MismatchCorrection(kind, hi=2.0, lo=0.5)
    ours = np.asarray(mismatch_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m), correction))
    np.testing.assert_allclose(ours, numpy_weights(logp_old, logp_infer, m, kind, 2.0, 0.5, None), rtol=1e-5)
    assert ours[0, 0] == (0.5 if kind == "seq-tis" else 0.0)  # below lo: clipped up, or rejected


@pytest.mark.parametrize("kind", CORRECTION_KINDS)
@pytest.mark.parametrize("junk", [-np.inf, np.nan])
def test_nonfinite_values_off_the_mask_change_nothing(kind, junk):
    """Engines report −inf (or nothing, NaN) where there is no sampled token: off the response
    mask that must not reach any weight or metric (masks select, they do not multiply)."""
    rng = np.random.default_rng(zlib.crc32(repr((kind, junk)).encode()))
    m = ragged(rng, 8, 10)
    logp_infer = -rng.uniform(0.05, 3, m.shape).astype(np.float32)
    logp_old = (logp_infer + rng.normal(scale=0.3, size=m.shape)).astype(np.float32)
    dirty = np.where(m > 0, logp_infer, junk).astype(np.float32)
    correction = MismatchCorrection(kind)
    clean_w = np.asarray(mismatch_weights(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m), correction))
    dirty_w = np.asarray(mismatch_weights(jnp.asarray(logp_old), jnp.asarray(dirty), jnp.asarray(m), correction))
    np.testing.assert_array_equal(dirty_w, clean_w)
    assert np.all(np.isfinite(dirty_w)) and (kind == "none" or np.any(dirty_w[m > 0] > 0))
    clean = mismatch_metrics(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m), correction)
    dirty_metrics = mismatch_metrics(jnp.asarray(logp_old), jnp.asarray(dirty), jnp.asarray(m), correction)
    for name, value in clean.items():
        np.testing.assert_array_equal(np.asarray(dirty_metrics[name]), np.asarray(value), err_msg=name)


def test_band_metric_uses_the_configured_bounds():
    logp_infer = np.zeros((1, 4), np.float32) - 1.0
    logp_old = logp_infer + np.log(np.array([[0.3, 0.6, 2.5, 4.0]], np.float32))
    m = np.ones((1, 4), np.float32)
    frac = lambda c: float(mismatch_metrics(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m),  # noqa: E731
                                            c)["mismatch_outside_band_frac"])
    assert frac(MismatchCorrection("icepop", hi=2.0)) == 0.75  # [0.5, 2]: GLM-5
    assert frac(MismatchCorrection("icepop", hi=5.0, lo=0.5)) == 0.25  # [0.5, 5]: verl / OpenRLHF
    assert frac(MismatchCorrection("tis", hi=2.0)) == 0.5  # [0, 2]: only k > 2
    for correction in (MismatchCorrection("none"), MismatchCorrection("tis"), MismatchCorrection("icepop", hi=5.0, lo=0.5)):
        fixed = mismatch_metrics(jnp.asarray(logp_old), jnp.asarray(logp_infer), jnp.asarray(m), correction)
        assert float(fixed["mismatch_outside_2x_frac"]) == 0.75  # [0.5, 2] whatever the correction


def test_mismatch_metrics_match_numpy():
    rng = np.random.default_rng(3)
    m = ragged(rng, 6, 8)
    li = -rng.uniform(0.1, 3, (6, 8)).astype(np.float32)
    lo = li + rng.normal(scale=0.8, size=(6, 8)).astype(np.float32)
    got = {k: float(v) for k, v in mismatch_metrics(jnp.asarray(lo), jnp.asarray(li), jnp.asarray(m)).items()}
    x = (lo.astype(np.float64) - li)
    k = np.exp(x)
    n = m.sum()
    np.testing.assert_allclose(got["mismatch_kl_k3"], ((k - 1 - x) * m).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(got["mismatch_abs_logp_diff"], (np.abs(x) * m).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(got["mismatch_ratio_max"], k[m > 0].max(), rtol=1e-5)
    np.testing.assert_allclose(got["mismatch_outside_band_frac"], (((k < 0.5) | (k > 2)) * m).sum() / n, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_outside_2x_frac"], (((k < 0.5) | (k > 2)) * m).sum() / n, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_ppl_ratio"], np.exp((x * m).sum() / n), rtol=1e-5)
    for q in (1, 10, 50, 90, 99):
        np.testing.assert_allclose(got[f"mismatch_ratio_q{q:02d}"], np.quantile(k[m > 0], q / 100), rtol=1e-5)
