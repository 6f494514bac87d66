"""GLM-5's architecture (MLA with DSA's indexer shared across layers) beyond parity with
transformers (test_model_parity holds the glm_moe_dsa checkpoint): the sparsity matters, no
gradient goes through the indexer's choice, the compressed cache decodes as the full forward does,
the embedded engine's log-probs are the trainer's, and index replay makes them so where the
engine's indexers chose other keys."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from opd_jax.models import Decoder, KVCache, ModelConfig
from opd_jax.models.mla import DSAConfig, MLAConfig
from opd_jax.models.moe import MoEConfig
from opd_jax.models.value import ValueModel
from opd_jax.sampling import Sampler, SamplingParams

# four layers: the indexer in 0 and 2, reused in 1 and 3; experts in 1 and 3; keys kept per query: 4
GLM5 = ModelConfig(family="glm_moe_dsa", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=4,
                   num_heads=4, num_kv_heads=4, head_dim=8, max_position_embeddings=256,
                   moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=16, router="sigmoid",
                                 norm_topk_prob=True, routed_scaling_factor=2.5, score_correction_bias=True,
                                 num_shared_experts=1, dense_layers=(0, 2)),
                   mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12),
                   dsa=DSAConfig(index_topk=4, index_head_dim=16, index_n_heads=8,
                                 indexer_types=("full", "shared", "full", "shared")))


def peaked(model: nnx.Module, scale: float = 6.0) -> nnx.Module:
    """The model with its matrices scaled up: peaked next-token distributions, decisive indexers."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 3 else x, state))
    return model


@pytest.fixture(scope="module")
def model():
    return peaked(Decoder(GLM5, rngs=nnx.Rngs(0)))


def dense_twin(model: Decoder) -> Decoder:
    """The same weights with every key attended (top-k past any sequence here)."""
    config = dataclasses.replace(GLM5, dsa=dataclasses.replace(GLM5.dsa, index_topk=1024))
    graphdef, state = nnx.split(model)
    twin = Decoder(config, rngs=nnx.Rngs(0))
    nnx.update(twin, state)
    return twin


def test_the_indexers_choice_changes_the_logits_and_takes_no_gradient(model):
    """Past 4 tokens the queries attend to 4 keys of the indexer's choosing: the logits are not
    dense attention's (before, they are); the loss's gradient reaches every MLA weight but none of
    the indexer's (its choice is discrete, as the router's correction bias), and the top-k really is a function of the indexer
    weights (moving them changes the logits)."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, GLM5.vocab_size, (2, 24)), jnp.int32)
    forward = nnx.jit(lambda model, tokens: model(tokens))
    sparse, dense = np.asarray(forward(model, tokens)), np.asarray(forward(dense_twin(model), tokens))
    np.testing.assert_allclose(sparse[:, :4], dense[:, :4], atol=1e-5)
    assert np.abs(sparse[:, 8:] - dense[:, 8:]).max() > 0.05 * np.abs(dense).max()

    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))["backbone"]["layers"]
    for name, g in grads.items():
        moved = float(jnp.abs(g).max())
        # the router's correction bias only selects experts (GLM-4.5's, as the indexer selects keys)
        assert (moved == 0) == (name.startswith("index_") or name == "router_bias"), (name, moved)
    bumped = nnx.merge(graphdef, jax.tree.map(lambda x: x, params))
    layers = bumped.backbone.layers
    layers.index_weights[...] = -layers.index_weights[...]  # the opposite keys win
    assert np.abs(np.asarray(forward(bumped, tokens))[:, 8:] - sparse[:, 8:]).max() > 1e-3


def _index_kl_numpy(q_index, weights, keys, q_latent, q_rope, latent, k_rope, allowed, scale, topk=None):
    """DeepSeek-V3.2's indexer KL per query, from the formula, in float64."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    q_index, weights, keys, q_latent, q_rope, latent, k_rope = map(f, (q_index, weights, keys, q_latent, q_rope,
                                                                      latent, k_rope))
    B, T, n, _ = q_latent.shape
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            keep = np.asarray(allowed[b, t])
            if not keep.any():
                continue
            heads = (q_latent[b, t] @ latent[b].T + q_rope[b, t] @ k_rope[b].T) * scale  # [n, S]
            heads = np.exp(heads - heads[:, keep].max(-1, keepdims=True)) * keep
            attention = (heads / heads.sum(-1, keepdims=True)).sum(0)
            index = (weights[b, t][:, None] * np.maximum(q_index[b, t] @ keys[b].T / np.sqrt(keys.shape[-1]), 0)).sum(0)
            chosen = np.flatnonzero(keep) if topk is None else [s for s in np.asarray(topk[b, t]) if s >= 0 and keep[s]]
            p = attention[chosen] / attention[chosen].sum()
            log_q = index[chosen] - np.log(np.exp(index[chosen] - index[chosen].max()).sum()) - index[chosen].max()
            out[b, t] = np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - log_q), 0))
    return out


def test_the_indexers_kl_to_the_attention_is_deepseek_v32s_and_trains_the_indexer_alone(model):
    """`mla.index_kl` equals the formula (NumPy): over every allowed key (the dense warm-up) and
    over a top-k (the sparse stage). Through the model (`index_loss`), its gradient reaches the
    indexer's weights and nothing else, and 40 Adam steps on it cut it to a tenth."""
    from opd_jax.models.mla import index_kl, index_scores, indexer_topk

    rng = np.random.default_rng(3)
    B, T, n, r, d, nI, dI = 2, 9, 3, 5, 4, 2, 6
    arrays = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in
              ((B, T, nI, dI), (B, T, nI), (B, T, dI), (B, T, n, r), (B, T, n, d), (B, T, r), (B, T, d))]
    allowed = jnp.asarray(np.tril(np.ones((T, T), bool))[None] & (rng.random((B, 1, T)) > 0.2))
    topk = indexer_topk(index_scores(arrays[0], arrays[2], arrays[1]), allowed, 3)
    for chosen in (None, topk):
        np.testing.assert_allclose(index_kl(*arrays, allowed, 0.7, chosen),
                                   _index_kl_numpy(*arrays, allowed, 0.7, chosen), rtol=2e-5, atol=1e-6)

    import optax

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, GLM5.vocab_size, (2, 24)), jnp.int32)
    graphdef, params = nnx.split(model, nnx.Param)

    def kl(params):
        _, info = nnx.merge(graphdef, params)(tokens, return_routing=True, index_loss="dense")
        return jnp.sum(info.index_kl[:, 0]) / jnp.sum(info.index_kl[:, 1])

    grads = nnx.to_pure_dict(jax.jit(jax.grad(kl))(params))
    moved = {"/".join(map(str, path)) for path, g in jax.tree_util.tree_leaves_with_path(grads)
             if float(jnp.abs(g).max()) > 0}
    assert moved and all("index_" in name for name in moved), moved

    tx = optax.adam(1e-2)  # zero gradients leave every other weight as it is

    @jax.jit
    def step(params, opt):
        loss, grads = jax.value_and_grad(kl)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    opt, losses, trained = tx.init(params), [], params
    for _ in range(40):
        trained, opt, loss = step(trained, opt)
        losses.append(float(loss))
    # measured: 0.025 -> 0.0005 nats per query (the indexer's distribution becomes the attention's)
    assert losses[-1] < 0.1 * losses[0], losses


def test_the_compressed_cache_decodes_as_the_full_forward(model):
    """Prefill 6 tokens then decode one at a time through a 40-slot cache (latent and rotary key
    per token in k, the indexer's key in v): every step's logits are the full forward's."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, GLM5.vocab_size, (2, 20)), jnp.int32)
    full = np.asarray(model(tokens))
    cache = KVCache.empty(GLM5, 2, 40, jnp.float32)
    assert cache.k.shape == (4, 2, 40, 1, 16 + 8) and cache.v.shape == (4, 2, 40, 1, 16)
    positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
    decode = nnx.jit(lambda model, tokens, cache, positions: model.decode(tokens, cache, positions=positions))
    logits, cache, _ = decode(model, tokens[:, :6], cache, positions[:, :6])
    np.testing.assert_allclose(np.asarray(logits), full[:, 5], atol=1e-5)
    for t in range(6, 20):
        logits, cache, _ = decode(model, tokens[:, t:t + 1], cache, positions[:, t:t + 1])
        np.testing.assert_allclose(np.asarray(logits), full[:, t], atol=1e-5)
    assert not np.asarray(cache.v[1]).any() and np.asarray(cache.v[0, :, :20]).any()  # shared layers keep no keys


@pytest.mark.parametrize("slots", [None, 3])
def test_the_engines_log_probs_are_the_trainers(model, slots):
    """Ragged prompts sampled by the embedded engine (one static batch, and continuous batching
    over 3 slots): each token's log-prob equals the trainer's scoring of the whole sequence
    (f32, 1e-5)."""
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, GLM5.vocab_size, n)) for n in (3, 11, 7, 1, 9)]
    params = SamplingParams(max_new_tokens=14, temperature=1.0)
    rollouts = Sampler(model, max_cache_len=64, slots=slots).generate(prompts, params, jax.random.key(3))
    seqs = [list(r.prompt_ids) + list(r.output_ids) for r in rollouts]
    tokens, mask = np.zeros((len(seqs), 32), np.int32), np.zeros((len(seqs), 32), np.int32)
    for i, seq in enumerate(seqs):  # right-padded: padding changes no real token's logits
        tokens[i, :len(seq)], mask[i, :len(seq)] = seq, 1
    score = nnx.jit(lambda model, tokens, mask: jax.nn.log_softmax(model(tokens, attention_mask=mask)))
    logp = np.asarray(score(model, jnp.asarray(tokens), jnp.asarray(mask)))
    for i, rollout in enumerate(rollouts):
        P, n = len(rollout.prompt_ids), len(rollout.output_ids)
        ref = logp[i, P - 1:P - 1 + n][np.arange(n), list(rollout.output_ids)]
        np.testing.assert_allclose(rollout.output_logprobs, ref, atol=1e-5)


def test_the_critic_reads_the_same_backbone(model):
    """A critic made from the GLM-5 policy: its values are its head on the policy's final hidden
    states, through the same sparse attention (a critic from the dense twin gives other values)."""
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, GLM5.vocab_size, (2, 16)), jnp.int32)
    critic = ValueModel.from_policy(model, head_init="small", key=jax.random.key(0), scale=0.1)
    value = nnx.jit(lambda critic, tokens: critic(tokens))
    values = np.asarray(value(critic, tokens))
    hidden, _ = nnx.jit(lambda model, tokens: model.backbone.forward(tokens))(model, tokens)
    np.testing.assert_allclose(values, np.asarray(hidden) @ np.asarray(critic.value_head[...]), atol=1e-5)
    twin = ValueModel.from_policy(dense_twin(model), head_init="small", key=jax.random.key(0), scale=0.1)
    assert np.abs(np.asarray(value(twin, tokens))[:, 8:] - values[:, 8:]).max() > 1e-3


def test_a_quantized_engine_computes_with_its_dequantized_weights_and_an_fp8_cache_close_to_them(model):
    """An int8 engine (MLA's projections and the experts quantized; the indexer and routers not):
    its log-probs are a full forward's with the dequantized weights (f32 cache: 1e-5), and the
    quantization is real. With an FP8 compressed cache (latent, rotary and indexer keys in e4m3,
    a scale per token) they stay within the cache's rounding of it (measured: 0.07 at most)."""
    from opd_jax.models.quant import QuantizedWeight, QuantScheme
    from opd_jax.train.build import EngineNumerics, engine_model

    engine = engine_model(GLM5, nnx.state(model, nnx.Param), EngineNumerics("float32", QuantScheme("int8", "channel")))
    layers = engine.backbone.layers
    assert all(isinstance(getattr(layers, n).get_value(), QuantizedWeight) for n in ("q_a", "q_b", "kv_a", "kv_b", "o"))
    assert not isinstance(layers.index_q.get_value(), QuantizedWeight)
    dequantized = Decoder(GLM5, rngs=nnx.Rngs(1))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name, value in vars(layers).items():
        if isinstance(value, nnx.Param) and isinstance(value.get_value(), QuantizedWeight):
            pure["backbone"]["layers"][name] = value.get_value().astype(jnp.float32)
    nnx.update(dequantized, pure)
    prompts = [list(np.random.default_rng(5).integers(0, GLM5.vocab_size, 9))]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    score = nnx.jit(lambda model, tokens: jax.nn.log_softmax(model(tokens)))
    for cache, atol in ((None, 1e-5), ("float8_e4m3fn", 0.15)):
        (rollout,) = Sampler(engine, max_cache_len=32, kv_cache_dtype=cache).generate(prompts, params,
                                                                                      jax.random.key(6))
        seq = jnp.asarray([list(rollout.prompt_ids) + list(rollout.output_ids)], jnp.int32)
        ids = list(rollout.output_ids)
        ref = np.asarray(score(dequantized, seq))[0, 8:-1][np.arange(10), ids]
        np.testing.assert_allclose(rollout.output_logprobs, ref, atol=atol)
    assert np.abs(ref - np.asarray(score(model, seq))[0, 8:-1][np.arange(10), ids]).max() > 1e-4


def test_the_prefix_cache_serves_the_compressed_cache(model):
    """Multi-turn episodes (each turn extends the last): with the prefix store, later turns
    prefill only what was appended, from stored latents and indexer keys, and every token, log-prob
    and expert equals the cache-off engine's."""
    from test_prefix_cache import assert_same, episodes

    plain = episodes(Sampler(model, slots=3))
    cached_sampler = Sampler(model, slots=3, prefix_cache_tokens=10_000)
    assert_same(plain, episodes(cached_sampler), atol=1e-5)
    assert cached_sampler.prefix_store.stats.take()["prefix_hit_frac"] > 0.5


def test_peft_loads_our_adapters_on_mla_and_the_merged_export_is_the_same_model(tmp_path):
    """LoRA on GLM-5's projections under PEFT's names (q_a_proj, q_b_proj, kv_a_proj_with_mqa,
    kv_b_proj, o_proj; kv_b's adapter folds into the absorbed attention): PEFT on the transformers
    model gives our logits over 20 tokens (past the top-k), and so does the merged export."""
    import peft
    import transformers
    from hf_reference import hf_logits, make_hf_model

    from opd_jax.models import load_model, save_model
    from opd_jax.models.adapter_io import save_adapter
    from opd_jax.models.lora import LoraConfig

    make_hf_model("glm_moe_dsa", tmp_path / "base")
    model, _ = load_model(tmp_path / "base")
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    model.add_lora(LoraConfig(rank=4, alpha=8.0, targets=targets), nnx.Rngs(3))
    keys = iter(jax.random.split(jax.random.key(4), 16))
    for name, var in vars(model.backbone.layers).items():
        if name.endswith("_lora_b"):  # B away from zero, so every adapter acts
            var[...] = 0.05 * jax.random.normal(next(keys), var[...].shape)
    assert {n[:-7] for n in vars(model.backbone.layers) if n.endswith("_lora_a")} == {"q_a", "q_b", "kv_a", "kv_b", "o"}
    tokens = np.random.default_rng(7).integers(0, 97, (2, 20)).astype(np.int32)
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    without = hf_logits(base, tokens)  # before PEFT wraps the base's modules in place
    save_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    theirs = hf_logits(peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval(), tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * np.abs(theirs).max())
    assert np.abs(theirs - without).max() > 1e-2  # the adapters act
    save_model(model, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(ours, hf_logits(merged, tokens), atol=1e-4 * np.abs(theirs).max())


def test_queries_in_chunks_attend_as_all_at_once():
    """A long sequence's queries attend (and choose their top-k) a chunk at a time, the last one
    padded: the output, the choices (`indexer_topk`, against a NumPy top-k) and the gradients are
    those of all queries at once (`mla_attention`)."""
    from opd_jax.models.mla import chunked_attention, chunked_topk, index_scores, indexer_topk, mla_attention

    rng = np.random.default_rng(8)
    B, T, n, r, d, nI, dI, k = 2, 23, 3, 8, 4, 5, 6, 4
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q_latent, q_rope, latent, k_rope = f(B, T, n, r), f(B, T, n, d), f(B, T, r), f(B, T, d)
    q_index, weights, keys = f(B, T, nI, dI), f(B, T, nI), f(B, T, dI)
    allowed = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
    topk = chunked_topk(q_index, weights, keys, allowed, k, chunk=5)
    out = chunked_attention(q_latent, q_rope, latent, k_rope, allowed, 0.3, topk, chunk=5)
    scores = np.asarray(index_scores(q_index, keys, weights))
    want = indexer_topk(jnp.asarray(scores), allowed, k)
    ranked = np.argsort(-np.where(np.asarray(allowed), scores, -np.inf), axis=-1, kind="stable")[..., :k]
    np.testing.assert_array_equal(np.sort(np.asarray(want)[:, k:], -1), np.sort(ranked[:, k:], -1))
    np.testing.assert_array_equal(np.asarray(topk), np.asarray(want))
    np.testing.assert_allclose(np.asarray(out), np.asarray(mla_attention(q_latent, q_rope, latent, k_rope, allowed, 0.3,
                                                                         want)), atol=1e-6)
    # and their gradients (a long sequence in training): the latents' and queries' through the chunks
    grads = [jax.grad(lambda ql, lat, c=c: jnp.sum(chunked_attention(ql, q_rope, lat, k_rope, allowed, 0.3, want,
                                                                    chunk=c) ** 2), argnums=(0, 1))(q_latent, latent)
             for c in (5, 512)]
    for chunked, whole in zip(*grads):
        np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=1e-5)
    dense = chunked_attention(q_latent, q_rope, latent, k_rope, allowed, 0.3, chunk=5)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(mla_attention(q_latent, q_rope, latent, k_rope, allowed, 0.3)),
                               atol=1e-6)


def numpy_flips(own: np.ndarray, engine: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per indexer layer, of the valid tokens with an engine record, the share whose set of key
    offsets differs from this model's own (own, engine: [B, T, layers, k])."""
    flips = []
    for layer in range(own.shape[2]):
        rows = [(b, t) for b, t in zip(*np.nonzero(valid)) if engine[b, t, layer, 0] >= 0]
        differ = [set(own[b, t, layer]) != set(engine[b, t, layer]) for b, t in rows]
        flips.append(np.mean(differ) if rows else 0.0)
    return np.asarray(flips)


def other_indexers_rollouts(model: Decoder, slots: int | None = None, temperature: float = 1.0) -> list:
    """Rollouts of an engine whose indexers differ from `model`'s (their weights perturbed, every
    other weight the same): it attends other keys for some tokens."""
    engine = Decoder(GLM5, rngs=nnx.Rngs(0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    layers, rng = pure["backbone"]["layers"], np.random.default_rng(9)
    for name in [n for n in layers if n.startswith("index_") and not n.endswith(("norm", "bias"))]:
        layers[name] = layers[name] + rng.normal(size=layers[name].shape).astype(np.float32) * np.std(layers[name])
    nnx.update(engine, pure)
    prompts = [list(rng.integers(0, GLM5.vocab_size, n)) for n in (3, 11, 7, 9)]
    return Sampler(engine, max_cache_len=64, slots=slots).generate(
        prompts, SamplingParams(max_new_tokens=14, temperature=temperature), jax.random.key(3))


@pytest.mark.parametrize("slots,pack", [(None, False), (3, True)])
def test_index_replay_attends_the_engines_keys(model, slots, pack):
    """An engine whose indexers differ from the trainer's (their weights perturbed, every other
    weight the same: the engine attends other keys) records, per prompt and output token and full
    indexer layer, the keys it attended as offsets back (-1: none). Without index replay the
    trainer attends its own keys: its log-probs are not the engine's, and its flip fraction per
    layer is NumPy's count of differing key sets; with `index_replay` it attends the engine's and
    its log-probs are the engine's (f32, 1e-5), in padded rows (static engine) and packed rows
    (continuous batching)."""
    from opd_jax.core.forward import sequence_logprobs
    from opd_jax.core.packing import pack_batch
    from opd_jax.envs import Trajectory
    from opd_jax.train.batching import trajectories_to_batch

    rollouts = other_indexers_rollouts(model, slots)
    for r in rollouts:
        offsets = np.asarray(r.index_offsets)
        n = len(r.prompt_ids) + len(r.output_ids)
        assert offsets.shape == (n, 2, 4) and np.asarray(r.routed_experts).shape == (n, 2, 2)
        position = np.arange(n)[:, None, None]
        assert np.all((offsets >= -1) & (offsets <= position)) and np.all(offsets[..., 0] >= 0)
        assert np.all((offsets >= 0).sum(-1) == np.minimum(position[..., 0] + 1, 4))  # every key while < k
    batch = trajectories_to_batch([Trajectory.single_turn(r, 0.0) for r in rollouts], pad_id=0)
    assert batch.indices.shape == (*batch.tokens.shape, 2, 4)
    if pack:
        batch = pack_batch(batch, groups=1, row_len=64)
    graphdef, params = nnx.split(model)
    score = jax.jit(lambda params, batch, replay: sequence_logprobs(graphdef, params, batch, with_router=True,
                                                                    index_replay=replay), static_argnums=2)
    mask = np.asarray(batch.response_mask) > 0
    engine_logp = np.asarray(batch.logp_infer)[mask]
    own, _, info = score(params, batch, False)
    assert np.abs(np.asarray(own)[mask] - engine_logp).max() > 1e-2
    valid = np.asarray(batch.attention_mask) > 0
    flips = numpy_flips(np.asarray(info.index_offsets), np.asarray(batch.indices), valid)
    np.testing.assert_allclose(np.asarray(info.index_flips), flips, atol=1e-6)
    assert flips.min() > 0.05, flips
    replayed, _, info = score(params, batch, True)
    np.testing.assert_allclose(np.asarray(replayed)[mask], engine_logp, atol=1e-5)
    # its own choice is still measured (the first layer's as before; the second's on the replayed states)
    again = numpy_flips(np.asarray(info.index_offsets), np.asarray(batch.indices), valid)
    np.testing.assert_allclose(np.asarray(info.index_flips), again, atol=1e-6)
    assert again[0] == pytest.approx(flips[0])


def test_a_ppo_run_replays_the_engines_keys_and_experts_and_says_what_the_engine_does_its_own_way(tmp_path):
    """A GLM-5-shaped policy trained by PPO (critic, sharded over 8 devices) from a bf16 engine
    with index replay and routing replay: the steps measure how many key sets the trainer would
    have chosen otherwise (policy/dsa/flip_frac, per indexer layer) and the run's record of the
    engine lists neither the keys nor the routing as differing (without index replay it lists the
    keys). Its warm start trains the indexers too (sft.indexer: a dense step, then a sparse one):
    the RL run's policy carries the indexers it trained (not their initialisation) and keeps them
    frozen, its checkpoint holding them. index_replay or sft.indexer on a model without DSA is one
    line naming it."""
    from types import SimpleNamespace

    from train_loop_settings import GLM5 as FRESH
    from train_loop_settings import TINY, like_state

    from opd_jax.config import ConfigError, load_config
    from opd_jax.train import read_metrics, train
    from opd_jax.train.checkpoint import Checkpoints
    from opd_jax.train.metrics import run_summary
    from opd_jax.train.rollouts import RolloutSession

    config = load_config(None, [*TINY, *FRESH, "steps=2", "sft.steps=2", "sft.indexer={dense_steps: 1}",
                                "rollout.dtype=bfloat16", "algorithm.ppo.routing_replay=r3",
                                "algorithm.ppo.index_replay=true", "logging.eval_every=2", "checkpoint.every=2",
                                f"logging.run_dir={tmp_path / 'run'}"])
    done = train(config)
    warm = read_metrics(done / "warm_start" / "metrics.jsonl")
    assert [r["step"] for r in warm if r.get("sft/index_kl", -1) >= 0] == [1, 2], warm
    checkpoints = Checkpoints(done / "checkpoints", keep=1)
    try:
        state, _ = checkpoints.restore(2, like_state(done))
    finally:
        checkpoints.close()
    fresh = like_state(done)  # the policy as the config initialises it
    layers = lambda tree: nnx.to_pure_dict(tree)["backbone"]["layers"]  # noqa: E731
    for name, value in layers(state.policy).items():
        if name.startswith("index_"):  # trained in the warm start (the norm's bias may start where it ends)
            assert name.endswith("_bias") or not np.array_equal(value, layers(fresh.policy)[name]), name
    assert not any("index_" in str(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.policy_opt))
    rows = [r for r in read_metrics(done / "metrics.jsonl") if "policy/dsa/flip_frac" in r]
    assert len(rows) == 2 and all(0 <= r["policy/dsa/flip_frac"] <= 1 for r in rows)
    assert {"policy/dsa/indexer0/flip_frac", "policy/dsa/indexer1/flip_frac"} <= set(rows[0])
    flips = np.mean([r["policy/dsa/flip_frac"] for r in rows])
    assert f"index flips {flips:.2%} of token-indexer layers" in run_summary(done, {})
    differs = json.loads((done / "run.json").read_text())["attempts"][-1]["engine"]["differs_in"]
    assert "routing" not in differs and "indices" not in differs and differs["precision"], differs
    session = SimpleNamespace(rollout=config.rollout, policy_config=GLM5, engine=SimpleNamespace(logprob_convention=""))
    own = RolloutSession.mismatch_sources(session, "float32", replays_routing=True, replays_indices=False)
    assert own["differs_in"]["indices"] == "the engine's own keys"
    with pytest.raises(ConfigError, match=r"algorithm.ppo.index_replay: the policy \(llama\) has no DSA indexer"):
        train(load_config(None, [*TINY, "steps=1", "algorithm.ppo.index_replay=true",
                                 f"logging.run_dir={tmp_path / 'llama'}"]))
    with pytest.raises(ConfigError, match=r"sft.indexer: the policy \(llama\) has no DSA indexer to train"):
        train(load_config(None, [*TINY, "steps=1", "sft.steps=1", "sft.indexer={dense_steps: 0}",
                                 f"logging.run_dir={tmp_path / 'llama2'}"]))


def test_an_opd_step_replays_a_glm5_students_keys_in_its_scoring_and_its_update(model):
    """OPD with a GLM-5 student whose engine's indexers differ: with `index_replay` its θ_old
    log-probs are the engine's (without, they are not), and the OPD step equals one SGD step on
    the sampled-token objective (reverse KL to a GLM-5 teacher through the IcePop-weighted clipped
    surrogate) written from the formulas, with the engine's keys attended."""
    import functools

    import optax
    from ppo_setup import assert_updates_close
    from test_opd_step import distill_batch, sgd_step_on_sampled_objective

    from opd_jax.core import OPDConfig, PolicyState, opd_step, score_student
    from opd_jax.envs import Trajectory
    from opd_jax.train.batching import trajectories_to_batch

    T, lr = 0.7, 0.05
    rollouts = other_indexers_rollouts(model, temperature=T)
    batch = trajectories_to_batch([Trajectory.single_turn(r, 0.0) for r in rollouts], pad_id=0)
    state = PolicyState.create(model, optax.sgd(lr))
    replayed = score_student(state, batch, temperature=T, index_replay=True)
    own = score_student(state, batch, temperature=T)
    m = np.asarray(batch.response_mask)
    np.testing.assert_allclose(np.asarray(replayed.logp_old) * m, np.asarray(batch.logp_infer) * m, atol=1e-5)
    assert np.abs(np.asarray(own.logp_old) - np.asarray(batch.logp_infer))[m > 0].max() > 1e-2
    teacher = peaked(Decoder(GLM5, rngs=nnx.Rngs(9)))
    distill = distill_batch(replayed, [teacher], np.zeros(len(rollouts), np.int64), "sampled")
    step = jax.jit(functools.partial(opd_step, config=OPDConfig(index_replay=True), num_teachers=1, temperature=T))
    new, _ = step(state, distill)
    r = distill.rollout
    expected = sgd_step_on_sampled_objective(
        state, distill, lr, T,
        lambda model: model(r.tokens, attention_mask=r.attention_mask, indices=r.indices,
                            replay_indices=r.attention_mask > 0))
    assert_updates_close(new.params, expected, state.params)


def test_the_glm5_quickstart_is_glm5s_shape_and_its_answers_attend_sparsely():
    """configs/quickstart_glm5.yaml (its learning is measured in BENCHMARKS.md over 3 seeds, too
    long for the suite): MLA, DSA whose indexers are shared by every other layer, routed and shared
    experts; the warm start trains the indexers and RL replays the engine's keys and experts; and
    on its task every answer token attends fewer keys than it has (top-k below the shortest
    prompt), so the indexer decides what the answer reads."""
    from pathlib import Path

    from opd_jax.config import load_config
    from opd_jax.data.domains import get_domain
    from opd_jax.models.char_tokenizer import char_tokenizer
    from opd_jax.train.build import fresh_model_config
    from opd_jax.train.preflight import check_indexer_training

    config = load_config(Path(__file__).parents[1] / "configs" / "quickstart_glm5.yaml", [])
    arch = fresh_model_config(config.model.fresh)
    assert arch.family == "glm_moe_dsa" and arch.mla is not None and arch.moe.num_shared_experts >= 1
    assert arch.dsa.indexer_types == ("full", "shared", "full", "shared") and arch.moe_layers == (1, 2, 3)
    assert config.sft.indexer.dense_steps < config.sft.steps
    check_indexer_training(config.sft, arch, lora=False)
    assert config.algorithm.ppo.index_replay and config.algorithm.ppo.routing_replay == "r3"
    assert config.rollout.dtype == "bfloat16"  # an engine whose choices can differ from the trainer's
    (source,) = config.data.train
    sample = get_domain(source.builtin).sampler(**(source.params or {}))
    tokenizer = char_tokenizer()
    rng = np.random.default_rng(0)
    shortest = min(len(tokenizer.encode(sample(rng)[0])) for _ in range(2000))
    assert arch.dsa.index_topk < shortest, (arch.dsa.index_topk, shortest)
