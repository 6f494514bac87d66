"""The typed training config, nested per concern. Every section forbids unknown keys; the core's
own frozen dataclasses (PPOConfig, OptimizerConfig, MeshConfig, ...) are used as-is, so a knob
is defined, defaulted and checked in exactly one place."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from opd_jax.core import OptimizerConfig, PPOConfig
from opd_jax.data.domains import get_domain
from opd_jax.models.attention import Implementation
from opd_jax.models.config import MLA_FAMILIES, MOE_FAMILIES, Family
from opd_jax.models.execution import Execution, Remat
from opd_jax.models.lora import ALL_LINEAR, MODULES, LoraConfig
from opd_jax.parallel import DistributedConfig, MeshConfig
from opd_jax.rewards.verifiers import VerifierName

DType = Literal["float32", "bfloat16", "float16"]


def _distributed_shorthand(value: Any) -> Any:
    """`distributed: auto` (or true / false) stands for `distributed: {enabled: ...}`."""
    return {"enabled": value} if isinstance(value, (bool, str)) else value


Distributed = Annotated[DistributedConfig, BeforeValidator(_distributed_shorthand)]


class Section(BaseModel):
    # every field's docstring is its description (docs/config.md, `opd-jax config explain`)
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class FreshMoE(Section):
    """The experts of a fresh MoE model (family qwen3_moe: softmax router; glm4_moe: sigmoid
    router with a selection bias, groups and shared experts)."""

    num_experts: int = Field(8, gt=0)
    """Routed experts per MoE layer."""
    experts_per_token: int = Field(2, gt=0)
    """Experts each token is routed to (top-k)."""
    intermediate_size: int = Field(64, gt=0)
    """Width of each routed expert's SwiGLU MLP."""
    norm_topk_prob: bool = True
    """Renormalise the k gates to sum to 1."""
    dense_layers: list[int] = []
    """Layers with a dense MLP (model.fresh.intermediate_size wide) instead of experts (glm4_moe: the first ones)."""
    num_shared_experts: int = Field(0, ge=0)
    """glm4_moe: shared experts (one dense MLP of num_shared × intermediate_size) added to every token."""
    routed_scaling_factor: float = Field(1.0, gt=0)
    """glm4_moe: gates × this."""
    n_group: int = Field(1, gt=0)
    """glm4_moe: expert groups; only the best topk_group groups are eligible per token."""
    topk_group: int = Field(1, gt=0)
    """glm4_moe: eligible groups per token."""


class FreshMLA(Section):
    """glm_moe_dsa: multi-head latent attention (docs/models.md): a low-rank query and one
    compressed latent per token from which every head's key and value are made."""

    q_lora_rank: int = Field(64, gt=0)
    """Rank of the query's projection (q_a_proj → q_b_proj)."""
    kv_lora_rank: int = Field(32, gt=0)
    """Width of the compressed key/value latent (what the cache holds per token, with the rotary key)."""
    qk_nope_head_dim: int = Field(16, gt=0)
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = Field(16, gt=0)
    """Per-head query width with rotary embedding, and the one rotary key's width (shared by every head)."""
    v_head_dim: int = Field(32, gt=0)
    """Per-head value width."""


class FreshDSA(Section):
    """glm_moe_dsa: DeepSeek sparse attention's lightning indexer (docs/models.md)."""

    index_topk: int = Field(16, gt=0)
    """Keys each query attends to, chosen by the indexer (all of them when the sequence is shorter)."""
    index_head_dim: int = Field(32, gt=0)
    """Width of the indexer's heads."""
    index_n_heads: int = Field(4, gt=0)
    """The indexer's heads."""
    indexer_types: list[Literal["full", "shared"]] | None = None
    """Per layer: full (runs its indexer) or shared (reuses the previous full layer's top-k). Unset: full in every layer."""


class FreshModel(Section):
    """A model initialised from scratch (for the synthetic domains), with the built-in
    character tokenizer; vocab_size comes from that tokenizer."""

    family: Family = "llama"
    """Architecture family: llama, qwen2 (q/k/v biases), qwen3 (q/k norm); MoE: qwen3_moe, glm4_moe (set moe), glm_moe_dsa (GLM-5: moe, mla, dsa)."""  # noqa: E501
    hidden_size: int = Field(128, gt=0)
    """Width of the residual stream."""
    intermediate_size: int = Field(384, gt=0)
    """Width of the SwiGLU MLP."""
    num_layers: int = Field(4, gt=0)
    """Decoder layers."""
    num_heads: int = Field(4, gt=0)
    """Query heads."""
    num_kv_heads: int = Field(2, gt=0)
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    head_dim: int = Field(32, gt=0)
    """Width of each attention head (glm_moe_dsa: its rotary part, mla.qk_rope_head_dim, which sets it)."""
    max_position_embeddings: int = Field(512, gt=0)
    """Longest sequence the model is built for (RoPE positions)."""
    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    """Fraction of head_dim the rotary embedding turns (GLM-4.5: 0.5)."""
    moe: FreshMoE | None = None
    """The experts (MoE families only)."""
    mla: FreshMLA | None = None
    """Multi-head latent attention (glm_moe_dsa only)."""
    dsa: FreshDSA | None = None
    """DeepSeek sparse attention's indexer (glm_moe_dsa only)."""
    seed: int = 0
    """Seed of the random initialisation."""

    @model_validator(mode="after")
    def _experts_for_moe_families(self):
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ValueError(f"model.fresh.moe must be set exactly for the MoE families (family {self.family})")
        mla = self.family in MLA_FAMILIES
        if (self.mla is not None) != mla or (self.dsa is not None) != mla:
            raise ValueError(f"model.fresh.mla and model.fresh.dsa must be set exactly for {', '.join(MLA_FAMILIES)} "
                             f"(family {self.family})")
        if mla:  # MLA gives every head its own key and value, and RoPE turns only the rotary part
            for name, value in (("head_dim", self.mla.qk_rope_head_dim), ("num_kv_heads", self.num_heads)):
                if name in self.model_fields_set and getattr(self, name) != value:
                    source = "mla.qk_rope_head_dim" if name == "head_dim" else "num_heads"
                    raise ValueError(f"model.fresh.{name} is {getattr(self, name)}, but {self.family} takes it from "
                                     f"model.fresh.{source} ({value}): leave {name} out or set it to {value}")
                self.__dict__[name] = value  # what the model has, so a run's config.yaml says it
        return self


class QuantizationSection(Section):
    """Weight-only quantization of the rollout engine's matmul weights (attention, MLP, experts;
    embeddings, LM head, norms and routers keep rollout.dtype). Re-quantized from the trainer's
    weights at every refit, deterministically. The trainer keeps its own precision."""

    kind: Literal["none", "fp8", "int8", "int4"] = "none"
    """none; fp8 (e4m3); int8 (per output channel); int4 (grouped)."""
    scales: Literal["channel", "block", "group"] | None = None
    """Scale granularity: fp8 channel (per output column) or block (block_size² blocks, as DeepSeek/SGLang FP8 checkpoints); int8 channel; int4 group (block_size input rows). Unset: the first named."""  # noqa: E501
    block_size: int = Field(128, gt=0)
    """Side of an fp8 block, length of an int4 group; must divide the weights it tiles."""

    @model_validator(mode="after")
    def _scales_fit_the_kind(self) -> QuantizationSection:
        self.scheme()  # QuantScheme names a kind / scales mismatch
        return self

    def scheme(self):
        """The models.quant.QuantScheme, or None for kind none."""
        from opd_jax.models.quant import SCALES, QuantScheme
        if self.kind == "none":
            return None
        return QuantScheme(self.kind, self.scales or SCALES[self.kind][0], self.block_size)


class LoraSection(Section):
    """Low-rank adapters (LoRA): the model is a frozen base and every phase of the command (a
    warm start included) trains only the adapters, whose optimizer state is all the optimizer
    holds (a critic trains its own adapters and value head). B starts at zero, so training starts
    from the base's function. Meant for a trained base (model.path): on model.fresh the base stays
    at its random initialisation. Exports write the merged model and, in hf_policy/adapter, the
    adapters in PEFT's format."""

    rank: int = Field(8, gt=0)
    """r: the adapters' inner dimension."""
    alpha: float = Field(16.0, gt=0)
    """α: the update is scaled by α/r."""
    targets: Literal["all-linear"] | list[str] = "all-linear"
    """PEFT module names to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; an MLP name covers a MoE model's shared and routed experts too), or all-linear: all seven."""  # noqa: E501
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """PEFT's lora_dropout: in training, each input element of an adapter (not of its base weight) is zeroed with this probability and the rest scaled by 1/(1-p); scoring and rollouts run without it. Routed experts' adapters take none (they are folded into the experts' weights)."""  # noqa: E501
    base_quantization: QuantizationSection = QuantizationSection()
    """QLoRA: the frozen base's matmul weights held in an engine format (fp8, int8, int4; as rollout.quantization), dequantized layer by layer in the forward; the adapters train in model.dtype."""  # noqa: E501

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: str | list[str]) -> str | list[str]:
        if targets != ALL_LINEAR:
            if not targets:
                raise ValueError(f"empty: name at least one module, or {ALL_LINEAR}")
            LoraConfig(rank=1, alpha=1.0, targets=tuple(targets))  # ValueError naming an unknown one
        return targets

    def spec(self) -> LoraConfig:
        """The adapters as the model builds them."""
        targets = tuple(MODULES) if self.targets == ALL_LINEAR else tuple(self.targets)
        return LoraConfig(rank=self.rank, alpha=self.alpha, targets=targets, dropout=self.dropout)


class ModelSection(Section):
    """The policy: exactly one of `path` and `fresh`."""

    path: str | None = None
    """A Hugging Face directory, a .gguf file, or a packaged model's name ('smollm2-135m-instruct')."""
    fresh: FreshModel | None = None
    """A model trained from scratch, with the character tokenizer."""
    dtype: DType = "float32"
    """Precision of the trainer's parameters."""
    compute_dtype: DType | None = None
    """Precision of the trainer's activations; unset: the parameters' dtype. float16: the updates use a dynamic loss scale (jmp; 2^15 at first, halved on an overflow, whose update is skipped and counted, doubled after 2000 finite ones)."""  # noqa: E501
    critic_head_init: Literal["zero", "small"] = "small"
    """Initial value head of the critic: all zeros, or small random weights."""
    lora: LoraSection | None = None
    """Train low-rank adapters on a frozen base instead of every weight (unset: full fine-tuning)."""
    attention: Implementation = "auto"
    """How the trainer's forward attends: dense ([B, T, T] scores), blockwise (FlashAttention's online softmax and its own backward: memory O(T), not O(T²)), or auto (blockwise once a sequence is longer than attention_block). Results equal to float rounding; docs/long_sequences.md. GLM-5's MLA goes the same way when it attends every key; DSA's top-k attends its k keys per query."""  # noqa: E501
    attention_block: int = Field(512, gt=0)
    """Queries and keys per block of the blockwise attention."""
    remat: Remat = "auto"
    """What the backward keeps of each layer's forward: everything (none), only the layer's input, the layer run again (full), the weight matmuls' outputs (dots), or those in host memory (offload: accelerators only); auto: full for sequences longer than 2048 tokens, none up to it. Any remat runs the layers as a rolled scan (update.layer_unroll does not apply)."""  # noqa: E501
    logits_chunk: int = Field(2048, gt=0)
    """Tokens whose logits exist at once when the trainer takes log-probs, entropies, OPD's divergences or its teachers' scores (the LM head runs chunk by chunk, forward and backward; [B, T, vocab] is never held)."""  # noqa: E501

    def execution(self) -> Execution:
        """How the trainer's forward computes, as these keys say."""
        return Execution(attention=self.attention, attention_block=self.attention_block, remat=self.remat,
                         logits_chunk=self.logits_chunk)

    @model_validator(mode="after")
    def _one_source(self):
        if self.path is not None and self.fresh is not None:
            raise ValueError("set exactly one of model.path and model.fresh; to train the model at model.path, "
                             "drop the config's fresh model with the override model.fresh=null")
        if self.path is None and self.fresh is None:
            raise ValueError("set exactly one of model.path and model.fresh (a pretrained model's directory, or "
                             "{family: llama, ...} for one built from scratch)")
        if self.dtype == "float16":  # AdamW's small updates vanish in float16 weights
            raise ValueError("model.dtype float16: keep float32 parameters and compute in float16 "
                             "(model.compute_dtype: float16, with dynamic loss scaling)")
        return self


class LaunchSection(Section):
    """Local SGLang servers the bridge starts and supervises: started on the initial policy,
    restarted on a crash (and on each refit when they lack update_weights_from_disk)."""

    command: list[str] = Field(min_length=1)
    """The server's argument list, with {model_path}, {host} and {port} placeholders."""
    num_servers: int = Field(1, gt=0)
    """How many servers to start."""
    host: str = "127.0.0.1"
    """Address they listen on."""
    ports: list[int] = []
    """Their ports (one per server); empty: free ports are picked."""
    env: dict[str, str] = {}
    """Environment variables added for the servers."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long a server may take to answer its health check."""


class SGLangClientSection(Section):
    """How the bridge talks to SGLang servers."""

    launch: LaunchSection | None = None
    """Servers the bridge launches (exclusive with urls)."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Timeout of one request."""
    max_retries: int = Field(5, ge=0)
    """Retries of a request after connection errors, 5xx, cut streams (then it fails)."""
    max_concurrency: int = Field(256, gt=0)
    """Requests in flight at once."""
    wait_for_servers_s: float = Field(0.0, ge=0)
    """Running servers (urls): how long to wait at start for one to answer its health check (a cluster's servers boot beside the trainer; 0: they must answer at once)."""  # noqa: E501


def check_server_source(servers: Any, uses_sglang: bool, key: str, engine: str) -> None:
    """Servers as `key` (rollout.sglang, teachers.sglang) gives them: exactly one of running
    ones (urls) and ones to launch when the engine (`engine`: the key that chose it) is SGLang,
    neither otherwise."""
    if uses_sglang and bool(servers.urls) == (servers.launch is not None):
        raise ValueError(f"{engine} 'sglang' needs exactly one of {key}.urls (running servers) and {key}.launch "
                         f"(servers to start)")
    if not uses_sglang and (servers.urls or servers.launch is not None):
        raise ValueError(f"{key}.urls / {key}.launch are for {engine} 'sglang'")


class SGLangSection(SGLangClientSection):
    """The rollout engine as SGLang servers: running ones at `urls` (or one sglang-router URL),
    or ones the bridge `launch`es."""

    urls: list[str] = []
    """Running servers, or one sglang-router URL (exclusive with launch)."""
    stream: bool = True
    """Stream responses (SSE) instead of waiting for whole ones."""
    stream_interval: int = Field(8, gt=0)
    """Streamed responses: one event per this many tokens (SGLang's per-request stream_interval): fewer events to parse; a rollout cut by a refit or crash resumes from its last event."""  # noqa: E501
    refit: Literal["auto", "disk", "restart"] = "auto"
    """New weights by pause → flush_cache → update_weights_from_disk → continue (disk), by relaunching the servers (restart), or disk where the server has the endpoint (auto)."""  # noqa: E501


class EpisodeSection(Section):
    """Multi-turn episodes of the environments in data.train (each model turn is at most
    rollout.max_new_tokens)."""

    max_turns: int = Field(8, gt=0)
    """Model turns per episode; an episode still going after them is truncated (the critic's value bootstraps)."""  # noqa: E501
    max_tokens: int = Field(512, gt=0)
    """Prompt, turns and observations of one episode; past it the episode is truncated."""
    timeout_s: float = Field(30.0, gt=0)
    """An environment's reset or step that takes longer fails its episode (reported; the step goes on)."""


class RolloutSection(Section):
    """How samples are drawn. `dtype` is the engine's precision, which may differ from the
    trainer's so the train/inference mismatch is real."""

    engine: Literal["embedded", "sglang"] = "embedded"
    """embedded: the JAX sampler in this process; sglang: SGLang servers (see rollout.sglang)."""
    sglang: SGLangSection = SGLangSection()
    """SGLang servers and client settings (engine sglang only)."""
    max_staleness: int = Field(0, ge=0)
    """Async RL: rollouts for the next steps are generated while this one trains; a group more than this many weight versions old is dropped (0: synchronous)."""  # noqa: E501
    keep_stale: bool = False
    """Keep (and count) stale groups instead of dropping them."""
    interrupted: Literal["resume", "discard"] = "resume"
    """A rollout cut by a refit: continued on the new weights, or discarded."""
    samples_per_prompt: int = Field(4, gt=0)
    """Samples per prompt (G): the group of GRPO and of the MOPD reward baseline."""
    max_new_tokens: int = Field(32, gt=0)
    """Longest response."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy); the trainer scores at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1: off)."""
    top_k: int = Field(0, ge=0)
    """Sample from the k most likely tokens (0: off)."""
    dtype: DType = "float32"
    """The engine's precision (bfloat16 against a float32 trainer: a real mismatch)."""
    quantization: QuantizationSection = QuantizationSection()
    """Weight-only quantization of the engine (fp8, int8, int4)."""
    kv_cache_dtype: Literal["bfloat16", "float8_e4m3fn"] | None = None
    """The engine's KV cache precision; unset: rollout.dtype. float8_e4m3fn keeps one scale per token and head."""
    decode_slots: int | None = Field(None, gt=0)
    """Embedded engine: decode at most this many requests at once by continuous batching (a finished one's slot goes to the next, also across calls: an episode's next turn joins as soon as it is ready); unset: each batch of requests (episodes: each round of turns) decodes together."""  # noqa: E501
    prefix_cache_gib: float = Field(1.0, ge=0)
    """Embedded engine's prefix cache: memory for the KV of sequences it ran, so a request that extends one (an episode's next turn) prefills only what was appended, and equal prompts of a batch share one prefill; least recently used evicted, cleared at every refit (0: off, every prompt prefilled in full)."""  # noqa: E501
    truncated: Literal["keep", "mask", "penalize"] = "keep"
    """A response cut at max_new_tokens: trained on as is, masked out of the loss, or given truncation_penalty as reward."""  # noqa: E501
    truncation_penalty: float = 0.0
    """The reward of a truncated response when truncated is penalize."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's overlong reward shaping: a response in the last this many tokens before max_new_tokens loses overlong_penalty × its share of them (0: off; core/algorithms/overlong.py)."""  # noqa: E501
    overlong_penalty: float = Field(1.0, ge=0)
    """The shaping's penalty at max_new_tokens (DAPO: 1)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop prompt groups whose rewards are all equal (no group-baseline signal) and draw more, so a step's batch is full of informative groups."""  # noqa: E501
    dynamic_sampling_rounds: int = Field(4, gt=0)
    """Dynamic sampling: draws per step at most; a batch still short then keeps uninformative groups (counted in rollout/dynamic_uninformative_groups)."""  # noqa: E501
    inject_weight_noise: float = Field(0.0, ge=0)
    """Research knob: add N(0, (noise·std(w))²) to the engine's weights at every sync, a mismatch larger than bf16's; drawn from (run seed, step), so seeds are independent draws."""  # noqa: E501
    episodes: EpisodeSection = EpisodeSection()
    """Budgets of multi-turn episodes (environment sources)."""

    @model_validator(mode="after")
    def _engine_settings(self) -> RolloutSection:
        check_server_source(self.sglang, self.engine == "sglang", "rollout.sglang", "rollout.engine")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(f"rollout.overlong_buffer {self.overlong_buffer} exceeds rollout.max_new_tokens "
                             f"{self.max_new_tokens}")
        if self.engine == "sglang" and self.decode_slots is not None:
            raise ValueError("rollout.decode_slots is the embedded engine's; SGLang servers batch continuously "
                             "by themselves (their --max-running-requests)")
        return self


def scoring_temperature(rollout: RolloutSection) -> float:
    """The temperature the trainer scores rollouts at: the engine's sampling temperature, so
    trainer and engine log-probs are of one distribution; greedy engines (T = 0) report
    log-probs at T = 1. Decided here, once, for every step and scoring pass."""
    return rollout.temperature or 1.0


class AlgorithmSection(Section):
    """The PPO step's knobs (`ppo.advantage`: GAE from the critic, the GLM-5.2 recipe, or a
    critic-free baseline, GRPO, RLOO or REINFORCE++, over groups of rollout.samples_per_prompt;
    `ppo.surrogate.kind`: PPO, GSPO or CISPO) and the two optimizers."""

    ppo: PPOConfig = PPOConfig()
    """The PPO step: advantages, the clipped IcePop surrogate, the critic, updates."""
    policy_optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-6)
    """The policy's optimizer."""
    critic_optimizer: OptimizerConfig = OptimizerConfig(learning_rate=5e-6)
    """The critic's optimizer."""


class SourceSpec(Section):
    """One prompt source: a built-in procedural domain (with its `params`, e.g. {digits: 3}), a
    JSONL file of {prompt or messages, answer, domain}, or a multi-turn environment (episodes)."""

    builtin: str | None = None
    """A built-in domain: addition, multiplication, reverse, sort, count, parity, max, copy_edit, chain, long_count, word_problems."""  # noqa: E501
    params: dict[str, int | float | str | bool] = {}
    """The built-in domain's or the environment's parameters, e.g. {digits: 3}."""
    jsonl: str | None = None
    """A JSONL file of {prompt or messages, answer, domain} records."""
    eval_jsonl: str | None = None
    """Held-out prompts of a JSONL source (built-in domains draw their own)."""
    eval_prompts: int | None = Field(None, gt=0)
    """Held-out problems of this built-in domain or environment; unset: data.eval_prompts_per_domain."""
    verifier: VerifierName | None = None
    """How a JSONL source's responses are judged: exact text, the last number, or math (boxed or plain answers, LaTeX, through math-verify); unset: numeric for numeric answers, else exact."""  # noqa: E501
    environment: str | None = None
    """A multi-turn environment: calculator, gridworld, search, or 'module:factory' (opd_jax.envs); held-out episodes come from its eval split."""  # noqa: E501
    domain: str | None = None
    """The environment's domain (metrics, OPD teacher routing); default: its name."""
    weight: float = Field(1.0, gt=0)
    """Its share of the training mix."""

    @model_validator(mode="after")
    def _one_kind(self):
        if sum(x is not None for x in (self.builtin, self.jsonl, self.environment)) != 1:
            raise ValueError("a data source sets exactly one of builtin, jsonl and environment")
        if self.builtin is not None:
            get_domain(self.builtin).sampler(**self.params)  # unknown domain or parameter: named here
        elif self.environment is not None:
            from opd_jax.envs.protocol import check_environment  # config is read before envs is needed

            check_environment(self.environment, self.params)
        elif self.params:
            raise ValueError("params apply to built-in domains and environments only")
        if self.verifier is not None and self.jsonl is None:
            raise ValueError("verifier applies to JSONL sources (built-in domains and environments judge their own)")
        if self.eval_prompts is not None and self.jsonl is not None:
            raise ValueError("eval_prompts applies to built-in domains and environments (a JSONL source's held-out "
                             "prompts are its eval_jsonl)")
        if self.domain is not None and self.environment is None:
            raise ValueError("domain names an environment's episodes; prompt sources carry their own")
        return self

    @property
    def domain_name(self) -> str:
        """An environment source's domain."""
        return self.domain or self.environment.rpartition(":")[2]


class DataSection(Section):
    """The prompts: a weighted mix of sources, how many per step, and the held-out sets."""

    train: list[SourceSpec] = [SourceSpec(builtin="addition")]
    """The prompt sources, mixed by weight."""
    prompts_per_step: int = Field(8, gt=0)
    """Prompts per training step (each sampled samples_per_prompt times)."""
    eval_prompts_per_domain: int = Field(32, gt=0)
    """Held-out problems per built-in domain or environment for the accuracy evaluation: distinct, and never in training or validation (a source's eval_prompts overrides it)."""  # noqa: E501
    held_out_share: float = Field(0.25, gt=0, le=0.5)
    """The share of each built-in domain's and environment's problems held out from training, chosen by a hash of each problem's content and data.seed (docs/config.md, 'Held-out problems'); the held-out prompts are drawn from it."""  # noqa: E501
    chat_template: bool = False
    """Wrap plain prompts in the model's chat template."""
    reward_fn: str | None = None
    """'module:function' reward(prompt, response, answer, domain) -> float, replacing the domain verifiers."""
    on_bad_reward: Literal["fail", "skip"] = "fail"
    """A reward function that raises or returns a non-number (or a NaN/inf reward): fail stops the
    run naming the function and the sample; skip drops the sample from the loss (and from held-out
    accuracy) and counts it in reward/bad_samples."""
    seed: int = 0
    """Seed of the prompt streams and of which problems are held out."""

    @property
    def has_environments(self) -> bool:
        """Whether any source is a multi-turn environment (episodes)."""
        return any(spec.environment is not None for spec in self.train)


class IndexerTrainingSection(Section):
    """A GLM-5 (DSA) policy's indexers trained in the supervised steps by DeepSeek-V3.2's rule: a
    KL from the attention's head-summed distribution to the indexer's softmax over the keys
    (docs/models.md), beside the cross-entropy, which never reaches them. Everywhere else (RL, the
    merge) they stay as they are."""

    dense_steps: int = Field(0, ge=0)
    """The first this many steps attend every key and take the KL over them all (the dense
    warm-up: a fresh indexer's choice is random); later steps attend the indexers' top-k and take
    it over those keys (the sparse stage)."""


class SFTSection(Section):
    """Supervised warm start on the training domains' reference answers before RL (steps = 0:
    none). RL needs a policy that sometimes succeeds."""

    steps: int = Field(0, ge=0)
    """Supervised updates before RL (0: none)."""
    batch_size: int = Field(32, gt=0)
    """Demonstrations per update."""
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-3)
    """The warm start's optimizer."""
    router_balance_coef: float = Field(0.01, ge=0)
    """MoE policies: weight of the routers' load-balancing loss (as pre-training uses; without it a
    fresh MoE sends nearly every token to the same experts). No effect on dense models."""
    pack: bool | Literal["auto"] = "auto"
    """Train on packed rows (demonstrations end to end, attention kept within each; auto: when
    that takes fewer rows than padding; see algorithm.ppo.update.pack)."""
    indexer: IndexerTrainingSection | None = None
    """GLM-5 (DSA) policies: train the indexers too (null: they stay as loaded or initialised)."""


class CheckpointSection(Section):
    """Orbax checkpoints of the whole train state and the prompt stream (exact resume)."""

    every: int = Field(50, gt=0)
    """Save every this many steps (and at the end)."""
    keep: int = Field(3, gt=0)
    """How many checkpoints to keep."""
    export_hf: bool = True
    """Write the trained policy as a Hugging Face directory (hf_policy/) at the end."""


class LoggingSection(Section):
    """Where a run's outputs go and how often it evaluates."""

    run_dir: str = "runs/default"
    """The run directory: config, metrics, checkpoints, exports."""
    eval_every: int = Field(10, gt=0)
    """Held-out evaluation every this many steps (and at the end)."""
    eval_at_start: bool = True
    """Evaluate before the first step."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    progress_bar: bool = True
    """Show a progress bar."""
    plot: bool = True
    """Write curves.png at the end."""
    dump_rollouts: bool = False
    """Write each step's trajectories to rollouts/step_NNNNNN.jsonl: token ids, text, loss mask, engine and trainer log-probs, rewards, advantages, values."""  # noqa: E501


class CensusSection(Section):
    """`opd-jax mismatch`: how far the rollout engine is from the trainer on the config's prompts
    (the engine samples, the trainer scores the same tokens), for one engine or several side by side."""

    samples: int = Field(256, gt=0)
    """Responses per engine and seed (drawn in batches of data.prompts_per_step × rollout.samples_per_prompt)."""
    seeds: list[int] = Field([0, 1, 2], min_length=1)
    """Sampling seeds; every figure is a mean over them, with its 95% Student's t interval from 2 seeds on (one seed: the figures alone, no interval)."""  # noqa: E501
    engines: dict[str, dict[str, Any]] = {}
    """Engines to compare, by name: each a set of `rollout` keys over the config's (e.g. {bf16: {dtype: bfloat16}, fp8: {dtype: bfloat16, quantization: {kind: fp8}}}); empty: the config's engine alone."""  # noqa: E501
    bands: list[tuple[float, float]] = [(0.5, 2.0), (0.5, 5.0), (0.8, 1.2)]
    """Bands [lo, hi] of the ratio π_trainer / π_engine; the fraction of tokens outside each is reported."""
    position_bins: int = Field(8, gt=0)
    """Bins of response position (equal widths up to the longest response) for the per-position table."""

    @model_validator(mode="after")
    def _bands_ordered(self) -> CensusSection:
        for lo, hi in self.bands:
            if not 0 < lo < 1 < hi:
                raise ValueError(f"census.bands: [{lo}, {hi}] must hold 1 with 0 < lo < 1 < hi")
        return self

    def engine_sections(self, rollout: RolloutSection) -> dict[str, RolloutSection]:
        """{name: the rollout section it runs}: each engine's keys merged over `rollout`."""
        if not self.engines:
            return {"engine": rollout}
        out = {}
        for name, keys in self.engines.items():
            try:
                out[name] = RolloutSection.model_validate(_merged(rollout.model_dump(), keys))
            except ValidationError as e:
                from opd_jax.config.load import _nearest  # load reads this module

                def problem(p: dict[str, Any]) -> str:
                    where = "".join(f".{part}" for part in p["loc"])
                    if p["type"] == "extra_forbidden":  # as for any config key: the nearest one named
                        near = _nearest(p["loc"], RolloutSection).replace("did you mean ", f"did you mean census.engines.{name}.")
                        return f"{where}: unknown key{near}"
                    return f"{where}: {p['msg']}"
                raise ValueError(f"census.engines.{name}" + "; ".join(problem(p) for p in e.errors())) from None
        return out


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class TrainConfig(Section):
    """`opd-jax train`: PPO (or GRPO) on the policy's own rollouts."""

    # what a resumed run cannot change without --force: its checkpoints' shapes, its prompt stream
    resume_fixed: ClassVar[tuple[str, ...]] = ("seed", "model", "data.train", "data.seed", "data.held_out_share",
                                               "data.chat_template",
                                               "algorithm.ppo.advantage")

    steps: int = Field(100, gt=0)
    """Training steps (one batch of rollouts each)."""
    seed: int = 0
    """Seed of sampling and of the critic's head."""
    model: ModelSection = ModelSection(fresh=FreshModel())
    """The policy."""
    mesh: MeshConfig = MeshConfig()
    """The device mesh the step is sharded over."""
    distributed: Distributed = DistributedConfig()
    """Multi-host start-up (`distributed: auto`: from a JobSet pod's environment)."""
    rollout: RolloutSection = RolloutSection()
    """The rollout engine and sampling."""
    algorithm: AlgorithmSection = AlgorithmSection()
    """The PPO step and its optimizers."""
    data: DataSection = DataSection()
    """The prompts."""
    sft: SFTSection = SFTSection()
    """The supervised warm start."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Checkpoints and the final export."""
    logging: LoggingSection = LoggingSection()
    """The run directory, evaluation and logs."""
    census: CensusSection = CensusSection()
    """`opd-jax mismatch`: the engines it measures, samples, seeds and bands."""

    @model_validator(mode="after")
    def _batch_splits(self) -> TrainConfig:
        group = self.rollout.samples_per_prompt
        try:
            self.algorithm.ppo.check_batch_size(self.data.prompts_per_step * group, group)
        except ValueError as e:
            raise ValueError(f"data.prompts_per_step × rollout.samples_per_prompt: {e} (algorithm.ppo.update)") from None
        try:
            self.algorithm.ppo.check_group_size(group)
        except ValueError as e:
            raise ValueError(f"algorithm.ppo: {e} (rollout.samples_per_prompt)") from None
        self.census.engine_sections(self.rollout)
        return self
