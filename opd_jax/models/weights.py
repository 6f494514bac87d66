"""Weight layout conversions: Hugging Face tensors <-> the decoder's stacked parameter tree.

Hugging Face stores torch `nn.Linear` weights as [out, in]; the decoder keeps [in, ..., out] with
heads split out (q: [hidden, heads, head_dim]), and every layer's weights stacked on axis 0 (the
dense MLP over the dense layers only, router and experts over the MoE layers only, each expert
weight stacked over experts: the hub's per-expert `mlp.experts.{e}.*` tensors).
One table describes each layer weight once; loading and saving both read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.models.config import ModelConfig, ModelFormatError

M = TypeVar("M", bound=nnx.Module)


@dataclasses.dataclass(frozen=True)
class _Weight:
    hf_suffix: str
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    ours_shape: Callable[[ModelConfig], tuple[int, ...]]
    transpose: bool  # True for linear weights: HF [out, in] <-> ours [in, ...out]
    present: Callable[[ModelConfig], bool] = lambda c: True
    layers: str = "all"  # which layers hold it: "all", "dense" (dense MLP), "moe" (router, experts) or
    # "indexer" (DSA's indexer, on the layers that run one)
    per_expert: bool = False  # one HF tensor per expert ("{e}" in hf_suffix), stacked on our axis 1

    def layer_ids(self, config: ModelConfig) -> tuple[int, ...]:
        return {"all": tuple(range(config.num_layers)), "dense": config.dense_layers,
                "moe": config.moe_layers, "indexer": config.indexer_layers}[self.layers]

    def hf_names(self, config: ModelConfig, layer: int) -> list[str]:
        if self.per_expert:
            return [f"model.layers.{layer}.{self.hf_suffix.format(e=e)}" for e in range(config.moe.num_experts)]
        return [f"model.layers.{layer}.{self.hf_suffix}"]


_H = lambda c: c.hidden_size  # noqa: E731
_gqa = lambda c: c.mla is None  # noqa: E731
_mla = lambda c: c.mla is not None  # noqa: E731
_shared = lambda c: c.moe.num_shared_experts * c.moe.intermediate_size if c.moe else 0  # noqa: E731
_LAYER_WEIGHTS: dict[str, _Weight] = {
    "attn_norm": _Weight("input_layernorm.weight", lambda c: (_H(c),), lambda c: (_H(c),), False),
    "q": _Weight("self_attn.q_proj.weight", lambda c: (c.num_heads * c.head_dim, _H(c)),
                 lambda c: (_H(c), c.num_heads, c.head_dim), True, _gqa),
    "k": _Weight("self_attn.k_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, _H(c)),
                 lambda c: (_H(c), c.num_kv_heads, c.head_dim), True, _gqa),
    "v": _Weight("self_attn.v_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, _H(c)),
                 lambda c: (_H(c), c.num_kv_heads, c.head_dim), True, _gqa),
    "o": _Weight("self_attn.o_proj.weight", lambda c: (_H(c), c.num_heads * c.v_head_dim),
                 lambda c: (c.num_heads, c.v_head_dim, _H(c)), True),
    # GLM-5's latent attention (MLA) and DSA's indexer (`opd_jax.models.mla`)
    "q_a": _Weight("self_attn.q_a_proj.weight", lambda c: (c.mla.q_lora_rank, _H(c)),
                   lambda c: (_H(c), c.mla.q_lora_rank), True, _mla),
    "q_a_norm": _Weight("self_attn.q_a_layernorm.weight", lambda c: (c.mla.q_lora_rank,),
                        lambda c: (c.mla.q_lora_rank,), False, _mla),
    "q_b": _Weight("self_attn.q_b_proj.weight", lambda c: (c.num_heads * c.mla.qk_head_dim, c.mla.q_lora_rank),
                   lambda c: (c.mla.q_lora_rank, c.num_heads, c.mla.qk_head_dim), True, _mla),
    "kv_a": _Weight("self_attn.kv_a_proj_with_mqa.weight",
                    lambda c: (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim, _H(c)),
                    lambda c: (_H(c), c.mla.kv_lora_rank + c.mla.qk_rope_head_dim), True, _mla),
    "kv_a_norm": _Weight("self_attn.kv_a_layernorm.weight", lambda c: (c.mla.kv_lora_rank,),
                         lambda c: (c.mla.kv_lora_rank,), False, _mla),
    "kv_b": _Weight("self_attn.kv_b_proj.weight",
                    lambda c: (c.num_heads * (c.mla.qk_nope_head_dim + c.mla.v_head_dim), c.mla.kv_lora_rank),
                    lambda c: (c.mla.kv_lora_rank, c.num_heads, c.mla.qk_nope_head_dim + c.mla.v_head_dim), True,
                    _mla),
    "index_q": _Weight("self_attn.indexer.wq_b.weight",
                       lambda c: (c.dsa.index_n_heads * c.dsa.index_head_dim, c.mla.q_lora_rank),
                       lambda c: (c.mla.q_lora_rank, c.dsa.index_n_heads, c.dsa.index_head_dim), True, _mla,
                       "indexer"),
    "index_k": _Weight("self_attn.indexer.wk.weight", lambda c: (c.dsa.index_head_dim, _H(c)),
                       lambda c: (_H(c), c.dsa.index_head_dim), True, _mla, "indexer"),
    "index_k_norm": _Weight("self_attn.indexer.k_norm.weight", lambda c: (c.dsa.index_head_dim,),
                            lambda c: (c.dsa.index_head_dim,), False, _mla, "indexer"),
    "index_k_norm_bias": _Weight("self_attn.indexer.k_norm.bias", lambda c: (c.dsa.index_head_dim,),
                                 lambda c: (c.dsa.index_head_dim,), False, _mla, "indexer"),
    "index_weights": _Weight("self_attn.indexer.weights_proj.weight", lambda c: (c.dsa.index_n_heads, _H(c)),
                             lambda c: (_H(c), c.dsa.index_n_heads), True, _mla, "indexer"),
    "q_bias": _Weight("self_attn.q_proj.bias", lambda c: (c.num_heads * c.head_dim,),
                      lambda c: (c.num_heads, c.head_dim), False, lambda c: c.qkv_bias),
    "k_bias": _Weight("self_attn.k_proj.bias", lambda c: (c.num_kv_heads * c.head_dim,),
                      lambda c: (c.num_kv_heads, c.head_dim), False, lambda c: c.qkv_bias),
    "v_bias": _Weight("self_attn.v_proj.bias", lambda c: (c.num_kv_heads * c.head_dim,),
                      lambda c: (c.num_kv_heads, c.head_dim), False, lambda c: c.qkv_bias),
    "o_bias": _Weight("self_attn.o_proj.bias", lambda c: (_H(c),), lambda c: (_H(c),), False,
                      lambda c: c.o_bias),
    "q_norm": _Weight("self_attn.q_norm.weight", lambda c: (c.head_dim,), lambda c: (c.head_dim,), False,
                      lambda c: c.qk_norm),
    "k_norm": _Weight("self_attn.k_norm.weight", lambda c: (c.head_dim,), lambda c: (c.head_dim,), False,
                      lambda c: c.qk_norm),
    "mlp_norm": _Weight("post_attention_layernorm.weight", lambda c: (_H(c),), lambda c: (_H(c),), False),
    "gate": _Weight("mlp.gate_proj.weight", lambda c: (c.intermediate_size, _H(c)),
                    lambda c: (_H(c), c.intermediate_size), True, layers="dense"),
    "up": _Weight("mlp.up_proj.weight", lambda c: (c.intermediate_size, _H(c)),
                  lambda c: (_H(c), c.intermediate_size), True, layers="dense"),
    "down": _Weight("mlp.down_proj.weight", lambda c: (_H(c), c.intermediate_size),
                    lambda c: (c.intermediate_size, _H(c)), True, layers="dense"),
    "router": _Weight("mlp.gate.weight", lambda c: (c.moe.num_experts, _H(c)), lambda c: (_H(c), c.moe.num_experts),
                      True, layers="moe"),
    "router_bias": _Weight("mlp.gate.e_score_correction_bias", lambda c: (c.moe.num_experts,),
                           lambda c: (c.moe.num_experts,), False, lambda c: bool(c.moe and c.moe.score_correction_bias), "moe"),
    "expert_gate": _Weight("mlp.experts.{e}.gate_proj.weight", lambda c: (c.moe.intermediate_size, _H(c)),
                           lambda c: (_H(c), c.moe.intermediate_size), True, layers="moe", per_expert=True),
    "expert_up": _Weight("mlp.experts.{e}.up_proj.weight", lambda c: (c.moe.intermediate_size, _H(c)),
                         lambda c: (_H(c), c.moe.intermediate_size), True, layers="moe", per_expert=True),
    "expert_down": _Weight("mlp.experts.{e}.down_proj.weight", lambda c: (_H(c), c.moe.intermediate_size),
                           lambda c: (c.moe.intermediate_size, _H(c)), True, layers="moe", per_expert=True),
    "shared_gate": _Weight("mlp.shared_experts.gate_proj.weight", lambda c: (_shared(c), _H(c)),
                           lambda c: (_H(c), _shared(c)), True, lambda c: _shared(c) > 0, "moe"),
    "shared_up": _Weight("mlp.shared_experts.up_proj.weight", lambda c: (_shared(c), _H(c)),
                         lambda c: (_H(c), _shared(c)), True, lambda c: _shared(c) > 0, "moe"),
    "shared_down": _Weight("mlp.shared_experts.down_proj.weight", lambda c: (_H(c), _shared(c)),
                           lambda c: (_shared(c), _H(c)), True, lambda c: _shared(c) > 0, "moe"),
}
# Tensors some checkpoints carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name this config needs, with its shape."""
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
              "model.norm.weight": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for w in _LAYER_WEIGHTS.values():
        if w.present(config):
            for i in w.layer_ids(config):
                shapes.update({name: w.hf_shape(config) for name in w.hf_names(config, i)})
    return shapes


def _extra_layer(name: str, config: ModelConfig) -> bool:
    """A tensor of a layer past the model's: GLM-4.5's multi-token-prediction layers, which
    transformers (and this model) do not use."""
    parts = name.split(".")
    return (config.family in ("glm4_moe", "glm_moe_dsa") and len(parts) > 2 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and int(parts[2]) >= config.num_layers)


def check_hf_tensors(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise ModelFormatError naming the first missing, unexpected or mis-shaped tensor."""
    expected = expected_hf_shapes(config)
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFormatError(f"{source}: tensor {missing[0]!r}{more} is missing for this config")
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = [n for n in shapes if n not in expected and n not in optional
                  and not n.endswith(_IGNORED_SUFFIXES) and not _extra_layer(n, config)]
    if unexpected:
        raise ModelFormatError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all) is "
                               f"not part of the {config.num_layers}-layer {config.architecture} config.json describes")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelFormatError(f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, "
                                   f"but config.json implies {shape}")


def _ours(w: _Weight, config: ModelConfig, hf: np.ndarray) -> np.ndarray:
    return (hf.T if w.transpose else hf).reshape(w.ours_shape(config))


def _theirs(w: _Weight, config: ModelConfig, ours: np.ndarray) -> np.ndarray:
    if w.transpose:
        return ours.reshape(-1, w.hf_shape(config)[0]).T
    return ours.reshape(w.hf_shape(config))


def params_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray], dtype: Any) -> dict[str, Any]:
    """The decoder's pure parameter dict, reading each HF tensor by name through `get`."""
    cast = lambda a: jnp.asarray(np.asarray(a), dtype=dtype)  # noqa: E731
    layers = {}
    for name, w in _LAYER_WEIGHTS.items():
        if w.present(config) and w.layer_ids(config):
            per_layer = [[_ours(w, config, get(n)) for n in w.hf_names(config, i)] for i in w.layer_ids(config)]
            layers[name] = cast(np.stack([np.stack(t) if w.per_expert else t[0] for t in per_layer]))
    params: dict[str, Any] = {"backbone": {"embed": cast(get("model.embed_tokens.weight")),
                                           "final_norm": cast(get("model.norm.weight")),
                                           "layers": layers}}
    if not config.tie_word_embeddings:
        params["lm_head"] = cast(np.asarray(get("lm_head.weight")).T)
    return params


def params_to_hf(config: ModelConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF tensor name -> contiguous numpy array (in the params' own dtype)."""
    host = jax.tree.map(np.asarray, dict(params))
    backbone = host["backbone"]
    out = {"model.embed_tokens.weight": backbone["embed"], "model.norm.weight": backbone["final_norm"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = host["lm_head"].T
    for name, w in _LAYER_WEIGHTS.items():
        if w.present(config):
            for j, i in enumerate(w.layer_ids(config)):
                stacked = backbone["layers"][name][j]
                for e, hf_name in enumerate(w.hf_names(config, i)):
                    out[hf_name] = _theirs(w, config, stacked[e] if w.per_expert else stacked)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def build_from_params(module_cls: type[M], config: ModelConfig, params: Mapping[str, Any],
                      compute_dtype: Any = None) -> M:
    """A `module_cls` (Decoder or ValueModel) holding exactly `params`; no random init is run.
    The parameter dtype is the embedding's."""
    param_dtype = params["backbone"]["embed"].dtype
    abstract = nnx.eval_shape(lambda: module_cls(config, param_dtype=param_dtype, compute_dtype=compute_dtype))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
