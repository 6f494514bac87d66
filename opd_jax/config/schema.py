"""The typed training config, nested per concern. Every section forbids unknown keys; the core's
own frozen dataclasses (PPOConfig, OptimizerConfig, MeshConfig, ...) are used as-is, so a knob
is defined, defaulted and checked in exactly one place."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from opd_jax.core import OptimizerConfig, PPOConfig
from opd_jax.data.domains import get_domain
from opd_jax.parallel import DistributedConfig, MeshConfig

DType = Literal["float32", "bfloat16"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FreshModel(Section):
    """A model initialised from scratch (for the synthetic domains), with the built-in
    character tokenizer; vocab_size comes from that tokenizer."""

    family: Literal["llama", "qwen2", "qwen3"] = "llama"
    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int = Field(32, gt=0)
    max_position_embeddings: int = Field(512, gt=0)
    seed: int = 0


class ModelSection(Section):
    """Exactly one of `path` (an HF directory, a .gguf file or a known name such as
    'smollm2-135m-instruct') and `fresh`."""

    path: str | None = None
    fresh: FreshModel | None = None
    dtype: DType = "float32"
    compute_dtype: DType | None = None
    critic_head_init: Literal["zero", "small"] = "small"

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.fresh is None):
            raise ValueError("set exactly one of model.path and model.fresh")
        return self


class LaunchSection(Section):
    """Local SGLang servers the bridge starts and supervises. `command` is the argument list with
    {model_path}, {host} and {port} placeholders; the servers start on the initial policy and
    are restarted on a crash (and on each refit when they lack update_weights_from_disk)."""

    command: list[str] = Field(min_length=1)
    num_servers: int = Field(1, gt=0)
    host: str = "127.0.0.1"
    ports: list[int] = []
    env: dict[str, str] = {}
    startup_timeout_s: float = Field(600.0, gt=0)


class SGLangOptions(Section):
    """How the bridge talks to SGLang. refit: 'disk' = pause → flush_cache →
    update_weights_from_disk → continue; 'restart' = relaunch on the new weights; 'auto' = disk
    where the server has the endpoint, else restart."""

    stream: bool = True
    refit: Literal["auto", "disk", "restart"] = "auto"
    request_timeout_s: float = Field(300.0, gt=0)
    max_retries: int = Field(5, ge=0)
    max_concurrency: int = Field(256, gt=0)


class RolloutSection(Section):
    """How samples are drawn. `dtype` is the engine's precision, which may differ from the
    trainer's so the train/inference mismatch is real. `truncated`: what a response cut at
    max_new_tokens gets: kept as is, masked out of the loss, or its reward set to
    `truncation_penalty`."""

    engine: Literal["embedded", "sglang"] = "embedded"
    urls: list[str] = []  # sglang: running servers (or one sglang-router URL) ...
    launch: LaunchSection | None = None  # ... or servers the bridge launches
    sglang: SGLangOptions = SGLangOptions()
    # async RL: rollouts for step n+1 are generated while step n trains; a group whose oldest
    # token is more than max_staleness weight versions old is dropped (kept with keep_stale)
    max_staleness: int = Field(0, ge=0)
    keep_stale: bool = False
    interrupted: Literal["resume", "discard"] = "resume"  # a rollout cut by a refit
    samples_per_prompt: int = Field(4, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    dtype: DType = "float32"
    truncated: Literal["keep", "mask", "penalize"] = "keep"
    truncation_penalty: float = 0.0
    # research knob: the engine's weights get N(0, (noise·std(w))²) added at every sync, a
    # train/inference mismatch larger than bf16's, to study the corrections under stress
    inject_weight_noise: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _engine_settings(self) -> RolloutSection:
        if self.engine == "sglang" and bool(self.urls) == (self.launch is not None):
            raise ValueError("engine 'sglang' needs exactly one of rollout.urls (running servers) and "
                             "rollout.launch (servers to start)")
        if self.engine == "embedded" and (self.urls or self.launch is not None):
            raise ValueError("rollout.urls / rollout.launch are for engine 'sglang'; the embedded engine has none")
        return self


class AlgorithmSection(Section):
    """The PPO step's knobs (`ppo.advantage`: GAE from the critic, the GLM-5.2 recipe, or the
    GRPO group baseline; `ppo.group_size` is set from rollout.samples_per_prompt) and the two
    optimizers."""

    ppo: PPOConfig = PPOConfig()
    policy_optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-6)
    critic_optimizer: OptimizerConfig = OptimizerConfig(learning_rate=5e-6)


class SourceSpec(Section):
    """One prompt source: a built-in procedural domain (with its `params`, e.g. {digits: 3}) or a
    JSONL file of {prompt or messages, answer, domain} (held-out prompts in `eval_jsonl`).
    `weight` is its share of the training mix."""

    builtin: str | None = None
    params: dict[str, int | float | str] = {}
    jsonl: str | None = None
    eval_jsonl: str | None = None
    weight: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.builtin is None) == (self.jsonl is None):
            raise ValueError("a data source sets exactly one of builtin and jsonl")
        if self.builtin is not None:
            get_domain(self.builtin).sampler(**self.params)  # unknown domain or parameter: named here
        elif self.params:
            raise ValueError("params apply to built-in domains only")
        return self


class DataSection(Section):
    train: list[SourceSpec] = [SourceSpec(builtin="addition")]
    prompts_per_step: int = Field(8, gt=0)
    eval_prompts_per_domain: int = Field(32, gt=0)
    chat_template: bool = False
    reward_fn: str | None = Field(None, description="'module:function' overriding the domain verifiers")
    seed: int = 0


class SFTSection(Section):
    """Supervised warm start on the training domains' reference answers before RL (steps = 0:
    none). RL needs a policy that sometimes succeeds."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(32, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-3)


class CheckpointSection(Section):
    every: int = Field(50, gt=0)
    keep: int = Field(3, gt=0)
    export_hf: bool = True


class LoggingSection(Section):
    run_dir: str = "runs/default"
    eval_every: int = Field(10, gt=0)
    eval_at_start: bool = True
    tensorboard: bool = True
    progress_bar: bool = True
    plot: bool = True


class TrainConfig(Section):
    steps: int = Field(100, gt=0)
    seed: int = 0
    model: ModelSection = ModelSection(fresh=FreshModel())
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    data: DataSection = DataSection()
    sft: SFTSection = SFTSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
