"""Everything a run is made of, built from its config: tokenizer, policy, critic, optimizers,
the engine's copy of the policy at the engine's precision, and prompt encoding."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.config import ModelSection, RolloutSection, TrainConfig
from opd_jax.data import Example
from opd_jax.models import Decoder, ModelConfig, Tokenizer, ValueModel, load_model, resolve_model_path
from opd_jax.models.char_tokenizer import char_tokenizer
from opd_jax.models.config import ModelFormatError, family_defaults
from opd_jax.models.lora import adapts_routed_experts, dequantized_params, merged_params
from opd_jax.models.mla import DSAConfig, MLAConfig
from opd_jax.models.moe import MoEConfig
from opd_jax.models.quant import QuantScheme, quantize_decoder
from opd_jax.models.weights import build_from_params


def build_model(section: ModelSection) -> tuple[Decoder, Tokenizer]:
    """The model a model section describes (fresh, with the character tokenizer, or loaded)."""
    if section.fresh is not None:
        tokenizer = char_tokenizer()
        policy = Decoder(fresh_model_config(section.fresh), param_dtype=jnp.dtype(section.dtype),
                         compute_dtype=section.compute_dtype, rngs=nnx.Rngs(section.fresh.seed))
        return policy.set_execution(section.execution()), tokenizer
    policy, tokenizer = load_model(resolve_model_path(section.path), dtype=section.dtype,
                                   compute_dtype=section.compute_dtype)
    if tokenizer is None:
        raise ModelFormatError(f"model.path {section.path!r} has no tokenizer; a run needs one to read prompts")
    return policy.set_execution(section.execution()), tokenizer


def add_configured_adapters(policy: Decoder, section: ModelSection, seed: int) -> Decoder:
    """`policy` with the LoRA adapters `section.lora` asks for added (in place; seeded by `seed`)
    and, for QLoRA, its base's matmul weights quantized; or as it is when it asks for none: what a
    training command trains."""
    if section.lora is not None:
        policy.add_lora(section.lora.spec(), nnx.Rngs(seed))
        scheme = section.lora.base_quantization.scheme()
        if scheme is not None:
            quantize_decoder(policy, scheme)
    return policy


# What a fresh model's section does not hold: the vocabulary and stop token (the character
# tokenizer's), and what its family fixes (family_defaults; a GLM-4.5 MoE's sigmoid router with
# a selection bias). Every other field is the section's own, under the same name: the section
# (config.FreshModel / FreshMoE) keeps the from-scratch defaults and descriptions, the dataclass
# (ModelConfig / MoEConfig) every model's meaning; tests/test_config.py checks the names match.
_NOT_FROM_SECTION = {"family", "moe", "mla", "dsa", "seed"}


def fresh_model_config(f: Any) -> ModelConfig:
    """The architecture a model.fresh section describes (vocabulary: the character tokenizer's);
    an inconsistent one raises ModelFormatError naming the problem."""
    tokenizer = char_tokenizer()
    fields = {name: getattr(f, name) for name in type(f).model_fields if name not in _NOT_FROM_SECTION}
    try:
        mla = dsa = None
        if f.mla is not None:  # GLM-5: every head its own key and value; head_dim is the rotary part
            mla = MLAConfig(**{name: getattr(f.mla, name) for name in type(f.mla).model_fields})
            types = f.dsa.indexer_types or ["full"] * f.num_layers
            dsa = DSAConfig(index_topk=f.dsa.index_topk, index_head_dim=f.dsa.index_head_dim,
                            index_n_heads=f.dsa.index_n_heads, indexer_types=tuple(types))
            fields.update(head_dim=mla.qk_rope_head_dim, num_kv_heads=f.num_heads)
        return ModelConfig(family=f.family, vocab_size=tokenizer.vocab_size, eos_token_ids=(tokenizer.eos_token_id,),
                           moe=_fresh_moe(f), mla=mla, dsa=dsa, **fields,
                           **family_defaults(f.family, qk_norm=f.family == "glm4_moe"))
    except ValueError as e:
        raise ModelFormatError(f"model.fresh: {e}") from None


def _fresh_moe(fresh: Any) -> MoEConfig | None:
    if fresh.moe is None:
        return None
    glm = fresh.family in ("glm4_moe", "glm_moe_dsa")
    fields = {name: getattr(fresh.moe, name) for name in type(fresh.moe).model_fields}
    fields["dense_layers"] = tuple(fields["dense_layers"])
    return MoEConfig(router="sigmoid" if glm else "softmax", score_correction_bias=glm, **fields)


def build_critic(policy: Decoder, config: TrainConfig) -> ValueModel:
    return ValueModel.from_policy(policy, head_init=config.model.critic_head_init,
                                  key=jax.random.key(config.seed + 1))


@dataclasses.dataclass(frozen=True)
class EngineNumerics:
    """How an embedded engine computes: parameter and activation dtype, weight quantization,
    KV cache precision. Each may differ from the trainer's, and each is a mismatch source."""

    dtype: str = "float32"
    quantization: QuantScheme | None = None
    kv_cache_dtype: str | None = None

    @classmethod
    def of(cls, rollout: RolloutSection) -> EngineNumerics:
        return cls(rollout.dtype, rollout.quantization.scheme(), rollout.kv_cache_dtype)

    def differences(self, trainer_dtype: str) -> dict[str, str]:
        """{source: what the engine does} for every way it computes unlike a `trainer_dtype` trainer."""
        out = {}
        if self.dtype != trainer_dtype:
            out["precision"] = self.dtype
        if self.quantization is not None:
            out["weights"] = str(self.quantization)
        if self.kv_cache_dtype not in (None, self.dtype):
            out["kv_cache"] = self.kv_cache_dtype
        return out


def serves_adapters(config: Any, numerics: EngineNumerics, noise: float) -> bool:
    """Whether the engine runs a LoRA policy as base + adapters, and so a refit moves only the
    adapters (`engine_adapters`): not where it quantizes the weights (it quantizes the merged
    ones), nor with weight noise (every weight moves), nor with adapters on routed experts (their
    forward would merge every expert's adapter at each decode step)."""
    return (config.lora is not None and numerics.quantization is None and not noise
            and not adapts_routed_experts(config))


def engine_model(config: Any, params: nnx.State, numerics: EngineNumerics, *, noise: float = 0.0,
                 version: int = 0, seed: int = 0, adapters: bool = True) -> Decoder:
    """The policy as the rollout engine runs it: its parameters cast to the engine's dtype, which
    may differ from the trainer's (bf16 engine, f32 trainer), so the mismatch is real, and its
    matmul weights quantized as `numerics` says (from the cast weights); `noise` adds
    N(0, (noise·std(w))²) to every weight (drawn from (seed, version): each run seed its own
    perturbation directions, each weight version its own draw) for a larger one. A policy with
    LoRA adapters runs as base + adapters where `serves_adapters`, else merged (each adapter
    folded into its base weight; adapters=False: merged in any case); a QLoRA base is dequantized."""
    pure = nnx.to_pure_dict(params)
    if adapters and serves_adapters(config, numerics, noise):
        pure = dequantized_params(pure)
    else:
        config, pure = merged_params(config, pure)
    if noise:
        leaves, tree = jax.tree.flatten(pure)
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), version), len(leaves))
        leaves = [w + noise * jnp.std(w) * jax.random.normal(k, w.shape, w.dtype) for w, k in zip(leaves, keys)]
        pure = jax.tree.unflatten(tree, leaves)
    # a copy even at the trainer's dtype (where astype returns the same array): the train step
    # donates its parameters, and an engine still decoding on them (prefetch) would read freed memory
    cast = jax.tree.map(lambda x: jnp.array(x, dtype=numerics.dtype, copy=True), pure)
    model = build_from_params(Decoder, config, cast, compute_dtype=numerics.dtype)
    return model if numerics.quantization is None else quantize_decoder(model, numerics.quantization)


def engine_adapters(params: nnx.State, numerics: EngineNumerics) -> dict[str, Any]:
    """A LoRA policy's adapters alone in the engine's dtype (a copy: the train step donates its
    parameters): what a refit moves to an engine that serves adapters."""
    adapters = nnx.to_pure_dict(nnx.filter_state(params, nnx.LoRAParam))
    return jax.tree.map(lambda x: jnp.array(x, dtype=numerics.dtype, copy=True), adapters)


def encode_prompt(example: Example, tokenizer: Tokenizer, chat_template: bool) -> list[int]:
    if example.messages is not None:
        return tokenizer.encode_chat(list(example.messages))
    if chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": example.prompt}])
    return tokenizer.encode(example.prompt)


def stop_ids(tokenizer: Tokenizer, policy: Decoder) -> tuple[int, ...]:
    ids = set(policy.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
