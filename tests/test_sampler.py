"""The embedded engine against a full forward recomputation and a NumPy reference of sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from opd_jax.models import Decoder, KVCache, ModelConfig
from opd_jax.models.moe import MoEConfig
from opd_jax.sampling import PromptTooLongError, Sampler, SamplingParams, sample_tokens, truncate_top_k_top_p

CONFIG = ModelConfig(family="qwen3", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, qkv_bias=True,
                     max_position_embeddings=256)


def make_model(seed=0, scale=10.0):
    """A random decoder whose weights are scaled up so its next-token distributions are peaked."""
    model = Decoder(CONFIG, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state))
    return model


@pytest.fixture(scope="module")
def model():
    return make_model()


def ragged_prompts(rng, lengths):
    return [list(rng.integers(0, CONFIG.vocab_size, n)) for n in lengths]


def recompute_logprobs(model, rollout, temperature):
    seq = np.array(rollout.prompt_ids + rollout.output_ids, np.int32)[None]
    logits = np.asarray(model(jnp.asarray(seq)))[0].astype(np.float64)
    P = len(rollout.prompt_ids)
    scaled = logits[P - 1:-1] / (temperature if temperature > 0 else 1.0)
    logp = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) - scaled.max(-1, keepdims=True)
    return logp[np.arange(len(rollout.output_ids)), list(rollout.output_ids)], logits[P - 1:-1]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.0, 1.0, 0)])
def test_logprobs_equal_full_forward(model, temperature, top_p, top_k):
    rng = np.random.default_rng(0)
    prompts = ragged_prompts(rng, [3, 11, 7, 1])
    sampler = Sampler(model)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k)
    rollouts = sampler.generate(prompts, params, jax.random.key(1))
    for prompt, rollout in zip(prompts, rollouts):
        assert rollout.prompt_ids == tuple(prompt)
        assert len(rollout.output_ids) == 12 and rollout.finish_reason == "length"
        ref, logits = recompute_logprobs(model, rollout, temperature)
        np.testing.assert_allclose(rollout.output_logprobs, ref, atol=1e-4)
        if temperature == 0:
            np.testing.assert_array_equal(rollout.output_ids, logits.argmax(-1))
        if top_k:  # every drawn token is inside the top-k of its step
            ranks = (logits > logits[np.arange(12), list(rollout.output_ids)][:, None]).sum(-1)
            assert ranks.max() < top_k


def test_kv_cache_decode_equals_no_cache_forward(model):
    rng = np.random.default_rng(2)
    seq = rng.integers(0, CONFIG.vocab_size, (2, 14)).astype(np.int32)
    full = np.asarray(model(jnp.asarray(seq)))
    cache = KVCache.empty(CONFIG, 2, 20, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(14, dtype=jnp.int32), (2, 14))
    logits, cache, _ = model.decode(jnp.asarray(seq[:, :6]), cache, positions=positions[:, :6])
    np.testing.assert_allclose(np.asarray(logits), full[:, 5], rtol=1e-5, atol=1e-4)
    for t in range(6, 14):
        logits, cache, _ = model.decode(jnp.asarray(seq[:, t:t + 1]), cache, positions=positions[:, t:t + 1])
        np.testing.assert_allclose(np.asarray(logits), full[:, t], rtol=1e-5, atol=1e-4)
    assert int(cache.length) == 14


@pytest.mark.parametrize("slots,kv", [(None, None), (2, None), (None, "bfloat16"), (None, "float8_e4m3fn")])
def test_long_responses_read_the_cache_span_by_span(slots, kv):
    """Responses that run through several 128-slot spans of the cache (a decode step reads only
    the spans written so far: decoder._cache_attention): every log-prob is still a full forward's,
    in one static batch and with continuous batching; a bf16 cache (written as raw bits) within
    its rounding of it; an fp8 cache gives what each request gets alone."""
    model = Decoder(dataclasses.replace(CONFIG, max_position_embeddings=1024), rngs=nnx.Rngs(5))
    prompts = ragged_prompts(np.random.default_rng(6), [5, 40, 17])
    params = SamplingParams(max_new_tokens=330, temperature=1.0)
    keys = jax.random.split(jax.random.key(3), len(prompts))
    rollouts = Sampler(model, slots=slots, kv_cache_dtype=kv).generate(prompts, params, keys)
    for i, rollout in enumerate(rollouts):
        assert len(rollout.output_ids) == 330
        if kv != "float8_e4m3fn":
            np.testing.assert_allclose(rollout.output_logprobs, recompute_logprobs(model, rollout, 1.0)[0],
                                       atol=1e-4 if kv is None else 0.05)
        else:
            (alone,) = Sampler(model, slots=1, kv_cache_dtype=kv).generate([prompts[i]], params, keys[i:i + 1])
            assert rollout.output_ids == alone.output_ids
            np.testing.assert_allclose(rollout.output_logprobs, alone.output_logprobs, atol=1e-4)


def test_same_key_same_samples_other_key_differs(model):
    prompts = ragged_prompts(np.random.default_rng(3), [4, 9])
    sampler = Sampler(model)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    a = sampler.generate(prompts, params, jax.random.key(7))
    b = sampler.generate(prompts, params, jax.random.key(7))
    c = sampler.generate(prompts, params, jax.random.key(8))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_ids for r in a] != [r.output_ids for r in c]
    # a row's sample does not depend on the rows after it in the batch
    d = sampler.generate(prompts + ragged_prompts(np.random.default_rng(4), [30]), params, jax.random.key(7))
    assert [r.output_ids for r in d[:2]] == [r.output_ids for r in a]


def test_stop_ids_end_sequences(model):
    prompts = ragged_prompts(np.random.default_rng(5), [5, 8, 2])
    sampler = Sampler(model)
    greedy = sampler.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), jax.random.key(0))
    stop = greedy[0].output_ids[3]  # a token row 0 emits at step 3
    stopped = sampler.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(stop,)),
                               jax.random.key(0))
    for before, after in zip(greedy, stopped):
        if stop in before.output_ids:
            cut = before.output_ids.index(stop) + 1
            assert after.output_ids == before.output_ids[:cut] and after.finish_reason == "stop"
            assert after.output_logprobs == pytest.approx(before.output_logprobs[:cut], abs=1e-5)
        else:
            assert after.output_ids == before.output_ids and after.finish_reason == "length"
    assert stopped[0].finish_reason == "stop" and len(stopped[0].output_ids) <= 4


def test_per_request_max_new_tokens(model):
    prompts = ragged_prompts(np.random.default_rng(6), [3, 3])
    out = Sampler(model).generate(prompts, [SamplingParams(max_new_tokens=4, temperature=0),
                                            SamplingParams(max_new_tokens=9, temperature=0)], jax.random.key(0))
    assert [len(r.output_ids) for r in out] == [4, 9]


def test_compiles_once_per_shape_and_across_weight_updates(model):
    sampler = Sampler(model)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95)
    sampler.generate(ragged_prompts(np.random.default_rng(7), [3, 5]), params, jax.random.key(0))
    compiled = sampler.compiled_variants()
    sampler.generate(ragged_prompts(np.random.default_rng(8), [9, 2]), params, jax.random.key(1))
    sampler.update_weights(make_model(seed=1), weight_version=3)
    out = sampler.generate(ragged_prompts(np.random.default_rng(9), [12, 16]),
                           SamplingParams(max_new_tokens=8, temperature=0.5, top_k=3), jax.random.key(2))
    assert sampler.compiled_variants() == compiled
    assert all(r.weight_version == 3 for r in out)


def test_batches_of_five_to_eight_share_one_compiled_variant_and_padding_changes_no_row(model):
    """A multi-turn run's live episodes shrink turn by turn (32, 30, 27, ...): batches are padded
    to a power of two, so 5..8 requests compile once, and each request's tokens are those it gets
    in a batch of its own bucket's size without padding (8 requests)."""
    prompts = ragged_prompts(np.random.default_rng(10), [2, 7, 4, 9, 3, 5, 6, 8])
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    keys = jax.random.split(jax.random.key(3), len(prompts))
    sampler = Sampler(model)
    full = sampler.generate(prompts, params, keys)
    compiled = sampler.compiled_variants()
    for n in (5, 6, 7):
        part = sampler.generate(prompts[:n], params, keys[:n])
        assert [r.output_ids for r in part] == [r.output_ids for r in full[:n]], n
        np.testing.assert_allclose([x for r in part for x in r.output_logprobs],
                                   [x for r in full[:n] for x in r.output_logprobs], atol=1e-5)
    assert sampler.compiled_variants() == compiled


def test_prompt_longer_than_cache_is_a_clear_error(model):
    sampler = Sampler(model, max_cache_len=32)
    with pytest.raises(PromptTooLongError, match="prompt 1 has 30 tokens.*max_new_tokens=8.*38 cache slots.*32"):
        sampler.generate([[1, 2], [3] * 30], SamplingParams(max_new_tokens=8), jax.random.key(0))
    with pytest.raises(ValueError, match="token id 99 outside the vocabulary"):
        sampler.generate([[1, 99]], SamplingParams(max_new_tokens=2), jax.random.key(0))


def numpy_truncate(scaled, top_k, top_p):
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep_sorted = (before < top_p) & ((np.arange(len(scaled)) < top_k) if top_k else True)
    out = np.full_like(scaled, -np.inf)
    out[order[keep_sorted]] = scaled[order[keep_sorted]]
    return out


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (4, 0.8), (1, 1.0)])
def test_truncation_matches_numpy(top_k, top_p):
    scaled = np.random.default_rng(top_k).normal(size=(5, 40)).astype(np.float32) * 2
    ours = np.asarray(truncate_top_k_top_p(jnp.asarray(scaled), jnp.full((5,), top_k), jnp.full((5,), top_p)))
    for row in range(5):
        np.testing.assert_array_equal(np.isinf(ours[row]), np.isinf(numpy_truncate(scaled[row], top_k, top_p)))


def test_sampling_frequencies_follow_the_truncated_distribution():
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    n = 20000
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logprobs = sample_tokens(jnp.tile(jnp.asarray(logits), (n, 1)), keys, jnp.full((n,), 1.0),
                                     jnp.full((n,), 0, jnp.int32), jnp.full((n,), 0.75))
    # nucleus 0.75: mass before token 2 is 0.65 < 0.75, before token 3 it is 0.8 -> keep {0, 1, 2}
    expected = np.array([0.4, 0.25, 0.15]) / 0.8
    freq = np.bincount(np.asarray(tokens), minlength=6) / n
    np.testing.assert_allclose(freq[:3], expected, atol=0.015)
    assert freq[3:].sum() == 0
    np.testing.assert_allclose(np.asarray(logprobs), logits[np.asarray(tokens)], atol=1e-6)


@pytest.mark.parametrize("V,masked", [(12, [0, 5, 11]), (300, [0, 127, *range(128, 256), 256, 299])])
def test_the_inverse_cdf_draw_follows_softmax_and_never_draws_a_masked_token(V, masked):
    """draw (one uniform per row) against the softmax probabilities by a chi-square test, with
    masked tokens (-inf) first, inside and last in the row, and at V = 300 (three blocks of its
    two-level search, the last one partial) at block edges and a whole block: they are never
    drawn, and a row with one unmasked token always draws it."""
    from scipy import stats

    from opd_jax.sampling.ops import draw

    rng = np.random.default_rng(3)
    logits = rng.normal(size=V).astype(np.float32) * (1.5 if V < 100 else 0.5)
    logits[masked] = -np.inf
    n = 40000 if V < 100 else 200000
    tokens = np.asarray(draw(jax.random.split(jax.random.key(1), n), jnp.tile(jnp.asarray(logits), (n, 1))))
    probs = np.exp(np.float64(logits) - logits.max())
    probs /= probs.sum()
    counts = np.bincount(tokens, minlength=V)
    assert counts[masked].sum() == 0
    live = probs > 0
    assert stats.chisquare(counts[live], probs[live] * n).pvalue > 1e-3
    alive = [1, V // 3, V // 2 + 1, V - 2]
    one = np.full((4, V), -np.inf, np.float32)
    one[np.arange(4), alive] = 0.0
    np.testing.assert_array_equal(draw(jax.random.split(jax.random.key(2), 4), jnp.asarray(one)), alive)


@settings(max_examples=60, deadline=None)
@given(logits=hnp.arrays(np.float32, (3, 17), elements=st.floats(-8, 8, width=32)),
       top_k=st.integers(0, 20), top_p=st.floats(0.05, 1.0))
def test_truncation_property_against_numpy(logits, top_k, top_p):
    """Kept set = NumPy reference wherever no two logits tie at the cut; the argmax is always kept."""
    ours = np.asarray(truncate_top_k_top_p(jnp.asarray(logits), jnp.full((3,), top_k), jnp.full((3,), top_p)))
    for row in range(3):
        ref = numpy_truncate(logits[row], top_k, top_p)
        assert np.isfinite(ours[row, logits[row].argmax()])
        if len(np.unique(logits[row])) == logits.shape[1]:
            np.testing.assert_array_equal(np.isinf(ours[row]), np.isinf(ref))


def test_truncated_sampling_logprobs_compare_like_with_like():
    """top_p 0.8, top_k 20 at T = 0.7, f32 engine and f32 trainer: the engine reports log-probs of
    the tempered distribution before truncation, the trainer scores the same distribution, so no
    token's ratio leaves [0.99, 1.01]. Had the engine reported the truncated, renormalised
    distribution it samples from (TRL's bug), many would."""
    from opd_jax.core import policy_logprobs
    from opd_jax.core.mismatch import MismatchCorrection, mismatch_metrics
    from opd_jax.train.batching import rollouts_to_batch

    model = make_model(scale=3.0)
    rng = np.random.default_rng(2)
    prompts = ragged_prompts(rng, [4, 9, 6, 2] * 4)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.8, top_k=20)
    rollouts = Sampler(model).generate(prompts, params, jax.random.key(3))
    batch = rollouts_to_batch(rollouts, np.zeros(len(rollouts)), pad_id=0)
    graphdef, state = nnx.split(model)
    trainer = policy_logprobs(graphdef, state, batch, temperature=0.7)
    band = dict(correction=MismatchCorrection("icepop", lo=0.99, hi=1.01))
    ours = mismatch_metrics(trainer, batch.logp_infer, batch.response_mask, **band)
    assert float(ours["mismatch_outside_band_frac"]) == 0.0

    # the truncated convention: log-probs renormalised over each step's kept tokens
    logits = np.asarray(model(batch.tokens)) / 0.7
    kept = np.asarray(truncate_top_k_top_p(jnp.asarray(logits.reshape(-1, logits.shape[-1])),
                                           jnp.full(logits.shape[0] * logits.shape[1], 20),
                                           jnp.full(logits.shape[0] * logits.shape[1], 0.8))).reshape(logits.shape)
    renormalised = jax.nn.log_softmax(jnp.asarray(kept), axis=-1)
    truncated = np.zeros_like(np.asarray(batch.logp_infer))
    tokens = np.asarray(batch.tokens)
    truncated[:, 1:] = np.take_along_axis(np.asarray(renormalised)[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    truncated = np.where(np.asarray(batch.response_mask) > 0, truncated, 0.0)
    theirs = mismatch_metrics(trainer, jnp.asarray(truncated), batch.response_mask, **band)
    assert float(theirs["mismatch_outside_band_frac"]) > 0.3, float(theirs["mismatch_outside_band_frac"])


# --- continuous batching -----------------------------------------------------------------------

TINY_MOE_SAMPLER = ModelConfig(family="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=256,
                               moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(0,)))


@pytest.mark.parametrize("kind", ["dense", "moe", "fp8_kv"])
def test_continuous_batching_equals_each_request_alone(model, kind):
    """Eleven requests of ragged prompts, budgets and stop ids through three slots: each one's
    tokens, log-probs, finish reason (and a MoE model's experts per token) are those it gets run
    alone with the same key; finished requests leave their slot to waiting ones."""
    if kind == "moe":
        model = Decoder(TINY_MOE_SAMPLER, rngs=nnx.Rngs(1))
    kv = "float8_e4m3fn" if kind == "fp8_kv" else None
    rng = np.random.default_rng(4)
    prompts = ragged_prompts(rng, rng.integers(1, 12, 11))
    params = [SamplingParams(max_new_tokens=int(rng.choice([3, 17, 40])), temperature=float(rng.choice([0.0, 0.8, 1.0])),
                             top_k=int(rng.choice([0, 5])), stop_token_ids=(3, 7)) for _ in prompts]
    keys = jax.random.split(jax.random.key(9), len(prompts))
    sampler = Sampler(model, max_cache_len=64, slots=3, kv_cache_dtype=kv)
    together = sampler.generate(prompts, params, keys)
    single = Sampler(model, max_cache_len=64, kv_cache_dtype=kv)
    lengths = set()
    for i, got in enumerate(together):
        (alone,) = single.generate([prompts[i]], [params[i]], keys[i:i + 1])
        assert got.output_ids == alone.output_ids and got.finish_reason == alone.finish_reason, i
        np.testing.assert_allclose(got.output_logprobs, alone.output_logprobs, atol=1e-4)
        if kind == "moe":
            np.testing.assert_array_equal(got.routed_experts, alone.routed_experts)
        lengths.add(len(got.output_ids))
    assert len(lengths) > 3 and {r.finish_reason for r in together} == {"stop", "length"}
