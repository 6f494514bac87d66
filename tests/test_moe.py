"""MoE routing and dispatch against independent references: NumPy written from the routing
formulas, transformers' own load-balancing loss, the dense every-expert oracle; and the property
that an expert shard gives exactly nothing to tokens none of whose experts it holds."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from opd_jax.models.moe import (
    MoEConfig,
    experts_dense,
    experts_ragged,
    load_balancing_loss,
    prob_per_expert,
    route,
    router_z_loss,
    tokens_per_expert,
)


def numpy_softmax_route(logits, k, norm):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    g = np.take_along_axis(p, ids, -1)
    return ids, g / g.sum(-1, keepdims=True) if norm else g


def numpy_sigmoid_route(logits, bias, k, n_group, topk_group, norm, scale):
    s = 1 / (1 + np.exp(-logits))
    c = s + bias
    N, E = c.shape
    groups = c.reshape(N, n_group, E // n_group)
    group_score = np.sort(groups, -1)[..., -2:].sum(-1)
    keep = np.zeros((N, n_group), bool)
    for n in range(N):
        keep[n, np.argsort(-group_score[n], kind="stable")[:topk_group]] = True
    masked = np.where(np.repeat(keep, E // n_group, -1), c, -np.inf)
    ids = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
    g = np.take_along_axis(s, ids, -1)
    if norm:
        g = g / (g.sum(-1, keepdims=True) + 1e-20)
    return ids, g * scale


def test_softmax_routing_matches_the_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 8)).astype(np.float32)
    for norm in (False, True):
        ids, gates = route(jnp.asarray(logits), MoEConfig(8, 3, 4, norm_topk_prob=norm))
        ref_ids, ref_gates = numpy_softmax_route(logits.astype(np.float64), 3, norm)
        np.testing.assert_array_equal(np.sort(ids, -1), np.sort(ref_ids, -1))
        order = np.argsort(ids, -1)
        np.testing.assert_allclose(np.take_along_axis(np.asarray(gates), order, -1),
                                   np.take_along_axis(ref_gates, np.argsort(ref_ids, -1), -1), rtol=1e-5)


def test_sigmoid_group_limited_routing_matches_the_formula():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(40, 12)).astype(np.float32)
    bias = rng.normal(scale=0.5, size=12).astype(np.float32)
    config = MoEConfig(12, 2, 4, router="sigmoid", n_group=3, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=2.5, score_correction_bias=True)
    ids, gates = route(jnp.asarray(logits), config, jnp.asarray(bias))
    ref_ids, ref_gates = numpy_sigmoid_route(logits.astype(np.float64), bias, 2, 3, 2, True, 2.5)
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(ref_ids, -1))
    np.testing.assert_allclose(np.sort(gates, -1), np.sort(ref_gates, -1), rtol=1e-5)
    # the bias only selects: the gates are the unbiased scores at the chosen experts
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    chosen = np.take_along_axis(s, np.asarray(ids), -1)
    np.testing.assert_allclose(gates, 2.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)


def test_forced_routing_keeps_the_ids_and_recomputes_the_gates():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(10, 6)).astype(np.float32))
    forced = jnp.asarray(rng.integers(0, 6, (10, 2)).astype(np.int32))
    config = MoEConfig(6, 2, 4, norm_topk_prob=True)
    ids, gates = route(logits, config, forced=forced)
    np.testing.assert_array_equal(ids, forced)
    p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    g = np.take_along_axis(p, np.asarray(forced), -1)
    np.testing.assert_allclose(gates, g / g.sum(-1, keepdims=True), rtol=1e-5)


def _problem(seed, N, E, k, H=8, I=6):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N, H)).astype(np.float32))
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32))
    gates = jnp.asarray(rng.uniform(0.1, 1.0, (N, k)).astype(np.float32))
    w = [jnp.asarray(rng.normal(scale=0.3, size=s).astype(np.float32)) for s in ((E, H, I), (E, H, I), (E, I, H))]
    return x, ids, gates, w


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), N=st.sampled_from([1, 5, 16]), E=st.sampled_from([2, 4, 8]), k=st.integers(1, 2))
def test_grouped_dispatch_equals_every_expert_on_every_token(seed, N, E, k):
    x, ids, gates, (gate, up, down) = _problem(seed, N, E, k)
    np.testing.assert_allclose(experts_ragged(x, ids, gates, gate, up, down), experts_dense(x, ids, gates, gate, up, down),
                               rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), N=st.sampled_from([1, 5, 16]), shards=st.sampled_from([2, 4]))
def test_an_expert_shard_gives_nothing_to_tokens_routed_elsewhere(seed, N, shards):
    """Each shard holds E/shards experts (the others zero, as on another device): a token none of
    whose experts the shard holds gets exactly 0 from it, and the shards' outputs add up to the
    whole layer's."""
    E, k = 8, 2
    x, ids, gates, (gate, up, down) = _problem(seed, N, E, k)
    whole = np.asarray(experts_ragged(x, ids, gates, gate, up, down))
    total = np.zeros_like(whole)
    per = E // shards
    for s in range(shards):
        held = (jnp.arange(E) // per == s)[:, None, None]
        part = np.asarray(experts_ragged(x, ids, gates, gate * held, up * held, down * held))
        elsewhere = ~np.isin(np.asarray(ids) // per, [s]).any(-1)
        assert np.all(part[elsewhere] == 0.0)
        total += part
    np.testing.assert_allclose(total, whole, rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_is_transformers_loss():
    rng = np.random.default_rng(3)
    E, k, B, T = 8, 2, 3, 5
    layers = [rng.normal(size=(B * T, E)).astype(np.float32) for _ in range(3)]
    mask = (rng.uniform(size=(B, T)) > 0.3).astype(np.int64)
    ref = float(load_balancing_loss_func(tuple(torch.tensor(g) for g in layers), E, k, torch.tensor(mask)))
    valid = jnp.asarray(mask.reshape(-1))
    f = jnp.stack([tokens_per_expert(route(jnp.asarray(g), MoEConfig(E, k, 4))[0], E, valid) for g in layers])
    P = jnp.stack([prob_per_expert(jnp.asarray(g), valid) for g in layers])
    np.testing.assert_allclose(float(load_balancing_loss(f, P)), ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(f).sum(-1), k, rtol=1e-6)


def test_router_z_loss_matches_the_formula():
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=3.0, size=(20, 6))
    valid = rng.uniform(size=20) > 0.5
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(router_z_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(valid))),
                               (lse**2)[valid].mean(), rtol=1e-5)


def test_router_losses_enter_the_policy_loss_with_their_coefficients():
    import dataclasses
    import functools

    from ppo_setup import TINY_MOE, make_state, scored_batch, step_optimizer

    from opd_jax.core import PPOConfig, ppo_step

    state = make_state(step_optimizer(), step_optimizer(), config=TINY_MOE)
    batch = scored_batch(state)
    step = lambda config: jax.jit(functools.partial(ppo_step, config=config))(state, batch)[1]  # noqa: E731
    plain = step(PPOConfig())
    weighted = step(dataclasses.replace(PPOConfig(), router_balance_coef=0.1, router_z_coef=0.01))
    balance, z = float(plain["policy/moe/balance_loss"]), float(plain["policy/moe/z_loss"])
    np.testing.assert_allclose(float(weighted["policy/total_loss"]) - float(plain["policy/total_loss"]),
                               0.1 * balance + 0.01 * z, rtol=1e-4)
    # the load metric from the model's own routing, counted here
    _, router = state.policy_model()(batch.tokens, attention_mask=batch.attention_mask, return_routing=True)
    ids = np.asarray(router.ids)[np.asarray(batch.attention_mask) > 0]  # [valid tokens, layers, k]
    counts = np.stack([np.bincount(ids[:, 0].ravel(), minlength=4)])
    np.testing.assert_allclose(float(plain["policy/moe/layer1/max_load"]), counts.max() / counts.mean(), rtol=1e-5)
    assert "policy/moe/layer0/max_load" not in plain  # layer 0 is dense


def test_the_engine_records_the_routing_the_trainer_computes():
    """f32 engine and f32 trainer: the expert ids the sampler records for every prompt and output
    token equal those of the trainer's forward over the same tokens."""
    from flax import nnx
    from ppo_setup import TINY_MOE

    from opd_jax.models import Decoder
    from opd_jax.sampling import Sampler
    from rollout_bridge.records import SamplingParams

    model = Decoder(TINY_MOE, rngs=nnx.Rngs(3))
    prompts = [[5, 9, 2, 7], [11, 3], [1, 2, 3, 4, 5, 6, 7]]
    rollouts = Sampler(model, max_cache_len=32).generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0),
                                                         jax.random.key(0))
    for r in rollouts:
        tokens = np.asarray([list(r.prompt_ids) + list(r.output_ids)], np.int32)
        _, router = model(jnp.asarray(tokens), return_routing=True)
        assert r.routed_experts.shape == (tokens.shape[1], 1, 2)  # one MoE layer, top-2
        np.testing.assert_array_equal(np.sort(r.routed_experts, -1), np.sort(np.asarray(router.ids)[0], -1))


def test_routing_replay_reproduces_the_engines_logits_under_a_different_routing():
    """The engine's model differs from the trainer's only in GLM's selection bias, which changes
    which experts are chosen but not their gates. The trainer on its own routes elsewhere (its
    logits differ); with R3 it uses the engine's experts and gives the engine's logits exactly."""
    import dataclasses

    from flax import nnx
    from ppo_setup import TINY_MOE

    from opd_jax.core import sequence_logits
    from opd_jax.models import Decoder
    from opd_jax.sampling import Sampler
    from opd_jax.train.batching import rollouts_to_batch
    from rollout_bridge.records import SamplingParams

    trainer = Decoder(dataclasses.replace(TINY_MOE, moe=dataclasses.replace(TINY_MOE.moe, n_group=1, topk_group=1)),
                      rngs=nnx.Rngs(5))
    graphdef, params = nnx.split(trainer)
    engine_params = jax.tree.map(jnp.copy, params)
    bias = engine_params["backbone"]["layers"]["router_bias"]
    bias[...] = jnp.asarray(np.random.default_rng(0).normal(scale=3.0, size=bias[...].shape), jnp.float32)
    assert not np.any(np.asarray(params["backbone"]["layers"]["router_bias"][...]))  # the trainer's stays 0
    engine = nnx.merge(graphdef, engine_params)
    rollouts = Sampler(engine, max_cache_len=32).generate([[5, 9, 2, 7], [11, 3, 8]],
                                                          SamplingParams(max_new_tokens=5, temperature=1.0),
                                                          jax.random.key(1))
    batch = rollouts_to_batch(rollouts, np.zeros(2), pad_id=0)
    assert batch.routing is not None and batch.routing.shape[2:] == (1, 2)
    engine_logits = np.asarray(sequence_logits(graphdef, engine_params, batch.replace(routing=None)))
    own, router = sequence_logits(graphdef, params, batch, with_router=True)
    replayed = np.asarray(sequence_logits(graphdef, params, batch, replay=True))
    real = np.asarray(batch.attention_mask) > 0
    assert float(router.flip_fraction[0]) > 0.3  # the trainer alone chooses other experts...
    assert np.abs(np.asarray(own) - engine_logits)[real].max() > 1e-3  # ...and its logits differ
    np.testing.assert_allclose(replayed[real], engine_logits[real], rtol=0, atol=1e-5)


def test_the_warm_start_trains_a_moe_policys_routers_toward_balance():
    """sft.router_balance_coef adds c · the load-balancing loss to the cross-entropy: under plain
    SGD the update with it minus the update without is −c · ∇(balance loss), the balance loss
    taken from a forward pass of its own."""
    import functools

    import optax
    from flax import nnx
    from ppo_setup import rollout_batch

    from opd_jax.core import sft_step
    from opd_jax.core.state import PolicyState
    from opd_jax.models import Decoder, ModelConfig
    from opd_jax.models.moe import MoEConfig

    config = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8,
                         moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(0,)))
    batch = rollout_batch(0)
    state = PolicyState.create(Decoder(config, rngs=nnx.Rngs(0)), optax.sgd(1.0))

    def update(coef: float):
        new, metrics = jax.jit(functools.partial(sft_step, router_balance_coef=coef))(state, batch)
        return jax.tree.map(lambda a, b: a - b, new.params, state.params), metrics

    plain, _ = update(0.0)
    weighted, metrics = update(0.25)
    np.testing.assert_allclose(float(metrics["sft/total_loss"]) - float(metrics["sft/loss"]),
                               0.25 * float(metrics["sft/moe/balance_loss"]), rtol=1e-5)

    def balance(params):
        _, router = nnx.merge(state.graphdef, params)(batch.tokens, attention_mask=batch.attention_mask,
                                                      return_routing=True)
        return load_balancing_loss(router.tokens_per_expert, router.prob_per_expert)

    grads = jax.grad(balance)(state.params)
    for d_w, d_p, g in zip(jax.tree.leaves(weighted), jax.tree.leaves(plain), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(d_w - d_p), -0.25 * np.asarray(g), atol=2e-6)
    router_grad = grads["backbone"]["layers"]["router"].value
    assert float(jnp.abs(router_grad).max()) > 1e-4  # the balance loss does reach the routers
