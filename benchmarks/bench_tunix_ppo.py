"""Tunix's PPO update on the same work as bench_ppo_step.py: its Llama3 model for the policy, a
Llama3 backbone with a linear score head for the critic, and one jitted train step of each of
its RL trainers with its registered "ppo" policy and value losses. Needs `pip install google-tunix`.
Not imported by opd_jax; only bench_ppo_step.py --tunix calls it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_common import best_time
from flax import nnx


def time_tunix(config, batch: int, prompt: int, response: int, dtype) -> float:
    """Seconds for one policy + one critic update with Tunix on a random batch."""
    from tunix.models.llama3 import model as llama
    from tunix.rl import algo_core
    from tunix.rl.ppo.ppo_learner import PPOConfig, TrainExample
    from tunix.rl.trainer import Trainer
    from tunix.sft.peft_trainer import TrainingConfig

    if jnp.dtype(dtype) != jnp.float32:
        raise SystemExit("the Tunix comparison runs in float32 only (its Llama3 has no compute-dtype knob)")
    model_config = llama.ModelConfig(
        num_layers=config.num_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
        hidden_dim=config.intermediate_size, num_heads=config.num_heads, head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads, rope_theta=int(config.rope_theta), norm_eps=config.rms_norm_eps,
        weight_tying=config.tie_word_embeddings)

    class Critic(nnx.Module):
        """A Llama3 backbone whose final hidden states go through a scalar score head: [B, T, 1]."""

        def __init__(self, rngs: nnx.Rngs):
            self.backbone = llama.Llama3(model_config, rngs=rngs)
            self.score = nnx.Linear(config.hidden_size, 1, use_bias=False, rngs=rngs)

        def __call__(self, tokens, positions, cache, attention_mask, **_):
            x = self.backbone.embedder.encode(tokens)
            for layer in self.backbone.layers:
                _, x = layer(x, positions, None, attention_mask)
            return self.score(self.backbone.final_norm(x))

    pad_id, eos_id = -1, -2  # random token ids never collide with these: every position is real
    ppo = PPOConfig(epsilon_low=0.2, epsilon_high=0.28)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6))
    training = TrainingConfig(eval_every_n_steps=10**9, max_steps=10**6)

    def trainer(model, loss_fn, inputs):
        t = Trainer(model, tx, training, custom_checkpoint_metadata_fn=dict)
        t.with_loss_fn(loss_fn, has_aux=True)
        t.with_gen_model_input_fn(inputs)
        return t.jit_train_and_eval_step()[0]

    actor_step = trainer(llama.Llama3(model_config, rngs=nnx.Rngs(0)), algo_core.ppo_policy_loss_fn,
                         lambda x: {"train_example": x, "algo_config": ppo, "pad_id": pad_id, "eos_id": eos_id})
    critic_step = trainer(Critic(nnx.Rngs(1)), algo_core.ppo_value_loss_fn,
                          lambda x: {"train_example": x, "clip_range_value": 0.2, "pad_id": pad_id, "eos_id": eos_id})

    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))
    example = TrainExample(
        prompt_ids=jnp.asarray(rng.integers(0, config.vocab_size, (batch, prompt)), jnp.int32),
        prompt_mask=jnp.ones((batch, prompt), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(0, config.vocab_size, (batch, response)), jnp.int32),
        completion_mask=jnp.ones((batch, response), jnp.int32),
        advantages=f32(batch, response), ref_per_token_logps=None,
        old_per_token_logps=-jnp.abs(f32(batch, response)), returns=f32(batch, response),
        old_values=f32(batch, response))

    def run():
        jax.block_until_ready((actor_step(example), critic_step(example)))

    return best_time(run)
