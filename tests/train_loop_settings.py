"""The tiny run the loop tests (and their subprocess workers) share, and the state its checkpoints
restore into."""

TINY = [
    "model.fresh.hidden_size=64", "model.fresh.intermediate_size=128", "model.fresh.num_layers=2",
    "model.fresh.num_heads=2", "model.fresh.num_kv_heads=1", "model.fresh.head_dim=32",
    "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
    "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
    "data.train=[{builtin: max, params: {hi: 9, min_len: 3, max_len: 3}}]",
    "data.prompts_per_step=4", "data.eval_prompts_per_domain=32",
    "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false",
    "checkpoint.export_hf=false",
]

# a GLM-5-shaped policy (MLA, DSA's indexer in layers 0 and 2, shared by 1 and 3, 4 keys per query, MoE)
GLM5 = ["model.fresh.family=glm_moe_dsa", "model.fresh.num_layers=4", "model.fresh.num_heads=2",
        "model.fresh.head_dim=8", "model.fresh.num_kv_heads=2",
        "model.fresh.moe={num_experts: 4, experts_per_token: 2, intermediate_size: 32, dense_layers: [0]}",
        "model.fresh.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8}",
        "model.fresh.dsa={index_topk: 4, index_head_dim: 16, index_n_heads: 4, "
        "indexer_types: [full, shared, full, shared]}"]

# a run long enough to kill and resume: checkpoints at steps 2, 4, 6; its policy a mixture of
# experts (experts sharded over the data axis) trained with routing replay, its engine's weights
# perturbed so that some tokens are routed differently: an exact resume covers the engine's
# recorded routing too; its prompts mixed with multi-turn episodes of the search game, whose
# stream of episodes resumes too; its forwards (warm start, scoring, steps) run on packed rows and
# its engine batches continuously (6 decode slots for 16 rollouts); its first step trains the
# critic only; a k3 KL to the frozen reference sits in its loss, so the reference is held, sharded,
# checkpointed and resumed too
RESUME_ARGS = ["steps=6", "sft.steps=2", "checkpoint.every=2", "logging.eval_every=3",
               "algorithm.ppo.update.pack=true", "sft.pack=true", "rollout.decode_slots=6",
               "data.train=[{builtin: max, params: {hi: 9, min_len: 3, max_len: 3}}, "
               "{environment: search, params: {hi: 3, max_guesses: 2}, eval_prompts: 1}]", "rollout.episodes.max_tokens=40",
               "model.fresh.family=qwen3_moe", "algorithm.ppo.routing_replay=r3", "rollout.inject_weight_noise=0.1",
               "algorithm.ppo.value_warmup_steps=1", "algorithm.ppo.kl={coef: 0.01, kind: k3, where: loss}",
               "model.fresh.moe={num_experts: 4, experts_per_token: 2, intermediate_size: 32, dense_layers: [0]}"]


def like_state(run_dir):
    """A fresh state of the run's config (policy, critic, optimizers and, with a KL term, the
    reference; with LoRA, the adapters): the tree a checkpoint of the run is restored into."""
    from opd_jax.config import load_config
    from opd_jax.core import PPOState, make_optimizer
    from opd_jax.train import build_critic, build_model
    config = load_config(run_dir / "config.yaml")
    policy, _ = build_model(config.model)
    if config.model.lora is not None:
        from opd_jax.train import add_configured_adapters
        add_configured_adapters(policy, config.model, config.seed)
    return PPOState.create(policy, build_critic(policy, config), make_optimizer(config.algorithm.policy_optimizer),
                           make_optimizer(config.algorithm.critic_optimizer), reference=config.algorithm.ppo.kl.enabled)
