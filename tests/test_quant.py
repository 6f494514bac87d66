"""Low-precision engines: weight quantization (FP8 e4m3 with channel or block scales, INT8 per
channel, INT4 grouped) against NumPy written from the schemes' formulas; the quantized engine's
logits against a forward of the dequantized weights; the FP8 KV cache; bad settings named before
anything trains."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from opd_jax.models import Decoder
from opd_jax.models.config import ModelConfig, ModelFormatError
from opd_jax.models.moe import MoEConfig
from opd_jax.models.quant import QuantizedWeight, QuantScheme, quantize_weight

CONFIG = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16,
                     moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=32, dense_layers=(0,)))


def reference(w: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scale, w / scale) of a [in, out] matrix by the scheme's formula: symmetric absmax
    scales over each column (channel), b×b block or b-row group; the integer bound is qmax + ½
    (qwix), values rounded half to even and saturated to the type's range; e4m3 by ml_dtypes'
    rounding."""
    n_in, n_out = w.shape
    rows = {"channel": n_in, "block": scheme.block, "group": scheme.block}[scheme.scales]
    cols = scheme.block if scheme.scales == "block" else 1
    tiles = np.abs(w).reshape(n_in // rows, rows, n_out // cols, cols).max(axis=(1, 3))
    bound = {"fp8": 448.0, "int8": 127.5, "int4": 7.5}[scheme.kind]
    scale = tiles / bound
    scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), 1.0, scale).astype(np.float32)
    x = w / np.repeat(np.repeat(scale, rows, 0), cols, 1)
    if scheme.kind == "fp8":
        q = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        qmax = 127 if scheme.kind == "int8" else 7
        q = np.clip(np.rint(x), -qmax - 1, qmax)
    return q, scale, x


@pytest.mark.parametrize("scheme", [QuantScheme("fp8", "block", 16), QuantScheme("fp8", "channel"),
                                    QuantScheme("int8", "channel"), QuantScheme("int4", "group", 16)], ids=str)
def test_weights_quantize_as_the_scheme_says(scheme):
    rng = np.random.default_rng(0)
    w = rng.normal(scale=0.05, size=(2, 64, 48)).astype(np.float32)  # [layers, in, out] ("gate")
    w[0, 5, 7] = 0.9  # one large weight: it sets its tile's scale and lands on the edge of the range
    w[1, :16, :16] = 0.0  # an all-zero tile: scale 1, zeros stay zero
    quantized = quantize_weight(jnp.asarray(w), "gate", scheme)
    for layer in range(2):
        q, scale, x = reference(w[layer], scheme)
        got = np.asarray(quantized.q.qvalue[layer].astype(jnp.float32))
        # a value a float rounding away from a half step (the tile's largest, at ±(qmax + ½)) may
        # round either way; every other value exactly as the formula says
        on_a_half = np.abs(np.abs(x - np.trunc(x)) - 0.5) < 1e-4
        assert not ((got != q) & ~on_a_half).any() and np.abs(got - q).max() <= 1
        np.testing.assert_allclose(np.asarray(quantized.q.scale[layer]), scale, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(quantized[layer].astype(jnp.float32)),
                                   got * np.repeat(np.repeat(scale, q.shape[0] // scale.shape[0], 0),
                                                 q.shape[1] // scale.shape[1], 1), rtol=1e-6)
    edge = float(quantized.q.qvalue[0].astype(jnp.float32)[5, 7])
    assert edge == {"fp8": 448.0, "int8": 127.0, "int4": 7.0}[scheme.kind]  # saturated at the type's max
    assert quantized.q.qvalue.dtype == {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.int4}[scheme.kind]


def stacked(engine: Decoder, name: str) -> np.ndarray:
    value = getattr(engine.backbone.layers, name).get_value()
    return np.stack([np.asarray(value[i].astype(jnp.float32)) for i in range(value.q.qvalue.shape[0])])


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
def test_the_quantized_engine_computes_with_the_dequantized_weights(kind):
    from opd_jax.train.build import EngineNumerics, engine_model

    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    scheme = QuantScheme(kind, "group" if kind == "int4" else "channel", 16)
    engine = engine_model(CONFIG, nnx.state(model, nnx.Param), EngineNumerics("float32", scheme))
    assert isinstance(engine.backbone.layers.expert_up.get_value(), QuantizedWeight)
    assert not isinstance(engine.backbone.layers.router.get_value(), QuantizedWeight)  # routers keep their precision
    reference_model = Decoder(CONFIG, rngs=nnx.Rngs(1))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name in ("q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down"):
        pure["backbone"]["layers"][name] = jnp.asarray(stacked(engine, name))
    nnx.update(reference_model, pure)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 10)))
    np.testing.assert_allclose(np.asarray(engine(tokens)), np.asarray(reference_model(tokens)), atol=1e-5)
    # and the quantization is real: the engine differs from the unquantized model
    assert float(jnp.abs(engine(tokens) - model(tokens)).max()) > 1e-4


def test_an_fp8_kv_cache_stores_scaled_e4m3_and_decodes_close():
    from opd_jax.models.decoder import KVCache, _from_cache, _to_cache

    x = jnp.asarray(np.random.default_rng(0).normal(scale=3.0, size=(2, 5, 4, 16)), jnp.float32)
    q, scale = _to_cache(x, jnp.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (2, 5, 4)
    np.testing.assert_allclose(np.abs(np.asarray(q.astype(jnp.float32))).max(-1), 448.0)
    ref = (np.asarray(x) / np.asarray(scale)[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), ref)
    back = np.asarray(_from_cache(q, scale, jnp.float32))
    assert np.abs(back - np.asarray(x)).max() <= np.abs(np.asarray(x)).max(-1, keepdims=True).max() / 16
    cache = KVCache.empty(CONFIG, 2, 8, jnp.float8_e4m3fn)
    assert cache.k_scale.shape == (2, 2, 8, 2) and KVCache.empty(CONFIG, 2, 8, jnp.bfloat16).k_scale is None


def test_a_block_size_that_does_not_divide_a_weight_is_named():
    with pytest.raises(ModelFormatError, match=r"block size 48 does not divide the input width 64 of weight layers.q"):
        quantize_weight(jnp.zeros((2, 64, 4, 16)), "q", QuantScheme("fp8", "block", 48))
    with pytest.raises(ValueError, match="int8 quantization takes scales channel, not 'block'"):
        QuantScheme("int8", "block")


def test_engine_settings_are_checked_before_anything_runs():
    from pathlib import Path

    from opd_jax.config import ConfigError, load_config
    from opd_jax.train.loop import PPOTask

    quickstart = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    blocks = load_config(quickstart, ["rollout.quantization.kind=fp8", "rollout.quantization.scales=block"])
    with pytest.raises(ConfigError, match=r"rollout.quantization.block_size: quantization block size 128 does not "
                                          r"divide the output width 64 of weight layers.k \(shape \(3, 128, 2, 32\)\)"):
        PPOTask(blocks).check_inputs()
    running = load_config(quickstart, ["rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:1]",
                                       "rollout.kv_cache_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="servers at rollout.sglang.urls run as they were started"):
        PPOTask(running).check_inputs()
    served = load_config(Path(__file__).parents[1] / "configs" / "quickstart_sglang.yaml", ["rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="rollout.dtype is bfloat16 but rollout.sglang.launch.command serves --dtype "
                                          "float32: make them agree"):
        PPOTask(served).check_inputs()
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype: Input should be 'bfloat16' or 'float8_e4m3fn'"):
        load_config(quickstart, ["rollout.kv_cache_dtype=int8"])
    with pytest.raises(ConfigError, match="int8 quantization takes scales channel, not 'group'"):
        load_config(quickstart, ["rollout.quantization.kind=int8", "rollout.quantization.scales=group"])


def test_an_fp8_engine_differs_from_the_trainer_more_than_a_bf16_engine():
    """The same prompts sampled by a bf16 engine and by a bf16 engine with FP8 weights, each
    rollout scored by the f32 trainer: per-sequence mean |Δlogp| is larger under FP8, by a one-
    sided Mann-Whitney U test at p < 0.01 (48 sequences each)."""
    from scipy import stats

    from opd_jax.core import policy_logprobs
    from opd_jax.sampling import Sampler
    from opd_jax.train.batching import rollouts_to_batch
    from opd_jax.train.build import EngineNumerics, engine_model
    from rollout_bridge.records import SamplingParams

    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    model_state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, model_state))  # peaked distributions
    graphdef, state = nnx.split(model)
    prompts = [list(p) for p in np.random.default_rng(0).integers(0, 64, (48, 6))]

    def per_sequence_dlogp(numerics: EngineNumerics) -> np.ndarray:
        engine = engine_model(CONFIG, nnx.state(model, nnx.Param), numerics)
        rollouts = Sampler(engine, max_cache_len=32).generate(prompts, SamplingParams(max_new_tokens=12),
                                                              jax.random.key(0))
        batch = rollouts_to_batch(rollouts, np.zeros(len(rollouts)), pad_id=0)
        trainer = np.asarray(policy_logprobs(graphdef, state, batch))
        mask = np.asarray(batch.response_mask)
        return (np.abs(trainer - np.asarray(batch.logp_infer)) * mask).sum(1) / mask.sum(1)

    bf16 = per_sequence_dlogp(EngineNumerics("bfloat16"))
    fp8 = per_sequence_dlogp(EngineNumerics("bfloat16", QuantScheme("fp8", "channel")))
    result = stats.mannwhitneyu(fp8, bf16, alternative="greater")
    assert result.pvalue < 0.01, (fp8.mean(), bf16.mean(), result)


def test_the_engine_owns_its_weights_even_at_the_trainers_dtype():
    """The train step donates the trainer's parameters; an engine still decoding the next step's
    rollouts on them (max_staleness > 0) must not be left holding freed buffers."""
    from opd_jax.train.build import EngineNumerics, engine_model
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    tokens = jnp.asarray([[1, 2, 3, 4]])
    engine = engine_model(CONFIG, params, EngineNumerics("float32"))
    before = np.asarray(engine(tokens))
    np.testing.assert_array_equal(before, np.asarray(model(tokens)))  # the same function, f32 on both sides
    jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(params)  # as the step does
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    np.testing.assert_array_equal(np.asarray(engine(tokens)), before)
