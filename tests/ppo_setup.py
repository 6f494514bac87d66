"""A tiny policy/critic pair and a ragged rollout batch for the PPO-step and sharding tests."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.core import (
    OptimizerConfig,
    PPOConfig,
    PPOState,
    RolloutBatch,
    SurrogateConfig,
    UpdateConfig,
    make_optimizer,
    score_batch,
)
from opd_jax.models import Decoder, ModelConfig, ValueModel
from opd_jax.models.moe import MoEConfig

# every sharded dimension divides by 2 and 4 (embed over fsdp, heads/mlp/vocab over tensor)
TINY = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


def tiny_models(config=TINY, compute_dtype=None, param_dtype=jnp.float32, execution=None):
    policy = Decoder(config, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=nnx.Rngs(0))
    if execution is not None:  # the critic's backbone copies it
        policy.set_execution(execution)
    critic = ValueModel.from_policy(policy, head_init="small", key=jax.random.key(1), scale=0.3)
    return policy, critic


# a GLM-4.5-style MoE of the same size: layer 0 dense, layer 1 routed (sigmoid, groups, a shared
# expert); 4 experts, so they split over data=2 or 4
TINY_MOE = ModelConfig(family="glm4_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, qkv_bias=True, partial_rotary_factor=0.5,
                       moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=16, router="sigmoid",
                                     norm_topk_prob=True, routed_scaling_factor=2.0, n_group=2, topk_group=1,
                                     score_correction_bias=True, num_shared_experts=1, dense_layers=(0,)))


def make_state(policy_tx, critic_tx, compute_dtype=None, config=TINY, param_dtype=jnp.float32, execution=None):
    policy, critic = tiny_models(config, compute_dtype=compute_dtype, param_dtype=param_dtype, execution=execution)
    return PPOState.create(policy, critic, policy_tx, critic_tx)


def rollout_batch(seed=0, B=16, T=12, prompt=4, vocab=TINY.vocab_size):
    """Prompts of `prompt` tokens, responses of ragged length (one empty), right padding; the
    engine's logprobs are filled in later from θ_old plus noise (see scored_batch)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    attn = np.zeros((B, T), np.int32)
    resp = np.zeros((B, T), np.float32)
    for i in range(B):
        end = prompt if i == 1 else int(rng.integers(prompt + 1, T + 1))
        attn[i, :end] = 1
        resp[i, prompt:end] = 1
    tokens[attn == 0] = 0
    return RolloutBatch(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attn),
                        response_mask=jnp.asarray(resp), logp_infer=jnp.zeros((B, T), jnp.float32),
                        rewards=jnp.asarray(rng.normal(size=B).astype(np.float32)))


def scored_batch(state, seed=0, B=16, T=12, noise=0.4):
    """A batch scored under the state's θ_old, with engine logprobs = θ_old + N(0, noise²) so some
    tokens fall outside the IcePop band."""
    batch = score_batch(state, rollout_batch(seed, B, T))
    rng = np.random.default_rng(seed + 1)
    noisy = batch.logp_old + jnp.asarray(rng.normal(scale=noise, size=(B, T)).astype(np.float32))
    return batch.replace(logp_infer=jnp.minimum(noisy, 0.0) * batch.response_mask)


# the step every sharding test runs: two mini-batches, Adam behind clipping
STEP_CONFIG = PPOConfig(update=UpdateConfig(minibatches=2), surrogate=SurrogateConfig(entropy_coef=0.01))


def step_optimizer():
    return make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0))


def assert_updates_close(new, ref, old, rtol=1e-3, atol_frac=5e-3):
    """Compare the parameter updates (new − old), which are what the step computes: each within
    rtol of its own size, or within atol_frac of the leaf's largest update. Adam's first update
    is about g / (|g| + eps): where |g| nears eps, the sharded reduction's other float order moves
    one element's update by a few 1e-3 of the largest (measured: 1 element of 3072, 1.1e-3; of
    4096 in a merge, 4.5e-3); a wrong update is off by the order of the update itself."""
    for n, r, o in zip(jax.tree.leaves(new), jax.tree.leaves(ref), jax.tree.leaves(old)):
        du, dr = np.asarray(n) - np.asarray(o), np.asarray(r) - np.asarray(o)
        np.testing.assert_allclose(du, dr, rtol=rtol, atol=atol_frac * max(np.abs(dr).max(), 1e-7))
