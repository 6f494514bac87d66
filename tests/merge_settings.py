"""The tiny base and experts that the experts and recipe tests share (each adds its steps)."""

BASE_AND_EXPERTS = [
    "base.model.fresh.hidden_size=32", "base.model.fresh.intermediate_size=64", "base.model.fresh.num_layers=1",
    "base.model.fresh.num_heads=2", "base.model.fresh.num_kv_heads=1", "base.model.fresh.head_dim=16",
    "base.sft.batch_size=16", "expert.rollout.samples_per_prompt=2", "expert.rollout.max_new_tokens=4",
    "expert.data.prompts_per_step=4", "expert.data.eval_prompts_per_domain=8", "expert.logging.progress_bar=false",
    "expert.logging.tensorboard=false", "expert.logging.plot=false",
]
