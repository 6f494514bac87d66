"""The decoder's architecture description, read from and written to Hugging Face `config.json`.

One frozen dataclass covers the dense Llama, Qwen2 and Qwen3 families and the mixture-of-experts
Qwen3-MoE, GLM-4.5 (`Glm4Moe`) and GLM-5 (`GlmMoeDsa`) families; the family decides defaults
(Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, GLM-4.5's partial rotary embedding), `moe`
describes the experts, and GLM-5's `mla` and `dsa` its multi-head latent attention and sparse
attention's indexer (`opd_jax.models.mla`). Every error names the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from opd_jax.errors import OpdJaxError
from opd_jax.models.lora import LoraConfig
from opd_jax.models.mla import DSAConfig, MLAConfig
from opd_jax.models.moe import MoEConfig

# the families, once: each with its Hugging Face architecture name (a new family starts here)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                  "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
FAMILIES: tuple[str, ...] = tuple(_ARCHITECTURES)
Family = Literal[FAMILIES]  # type: ignore[valid-type]
MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "glm4_moe", "glm_moe_dsa")
MLA_FAMILIES: tuple[str, ...] = ("glm_moe_dsa",)  # multi-head latent attention with DSA's indexer
_FAMILY_OF_ARCHITECTURE = {v: k for k, v in _ARCHITECTURES.items()}


def family_defaults(family: str, attention_bias: bool = False, qk_norm: bool = False) -> dict[str, bool]:
    """The architecture switches a family fixes, in one place (fresh models and loaded ones):
    Qwen2's q/k/v biases (no output bias), Qwen3's (and Qwen3-MoE's) per-head q/k RMSNorm; Llama
    and Qwen3 take `attention_bias` for q/k/v/o alike; GLM-4.5 takes it for q/k/v only (its output
    projection has no bias) and `use_qk_norm` for the q/k RMSNorm."""
    if family == "glm4_moe":
        return {"qkv_bias": attention_bias, "o_bias": False, "qk_norm": qk_norm}
    if family in MLA_FAMILIES:  # its projections are MLA's own (opd_jax.models.mla)
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}
    return {"qkv_bias": True if family == "qwen2" else attention_bias,
            "o_bias": False if family == "qwen2" else attention_bias,
            "qk_norm": family in ("qwen3", "qwen3_moe")}


class ModelFormatError(OpdJaxError, ValueError):
    """A model file or directory that cannot be read as one of the supported decoders."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3-style ("llama3") or linear position interpolation of the rotary frequencies."""

    kind: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    partial_rotary_factor: float = 1.0  # the fraction of head_dim the rotary embedding turns (GLM-4.5: 0.5)
    moe: MoEConfig | None = None  # the experts of a MoE family (None: a dense model)
    mla: MLAConfig | None = None  # GLM-5: multi-head latent attention (head_dim is then its rotary part)
    dsa: DSAConfig | None = None  # GLM-5: DeepSeek sparse attention's indexer and its top-k
    lora: LoraConfig | None = None  # low-rank adapters on the projections (None: none); not part of config.json

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelFormatError(f"unknown model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelFormatError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelFormatError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelFormatError(f"partial_rotary_factor {self.partial_rotary_factor} gives {self.rotary_dim} "
                                   f"rotary dimensions of head_dim {self.head_dim}; it must be even and positive")
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ModelFormatError(f"family {self.family!r} {'needs' if self.moe is None else 'takes no'} a MoE config")
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.dense_layers):
            raise ModelFormatError(f"dense layers {list(self.moe.dense_layers)} are not all in [0, {self.num_layers})")
        mla = self.family in MLA_FAMILIES
        if (self.mla is not None) != mla or (self.dsa is not None) != mla:
            raise ModelFormatError(f"family {self.family!r} {'needs' if mla else 'takes no'} MLA and DSA configs")
        if self.mla is not None:
            if self.head_dim != self.mla.qk_rope_head_dim or self.num_kv_heads != self.num_heads:
                raise ModelFormatError(f"an MLA model's head_dim is its rotary part (qk_rope_head_dim "
                                       f"{self.mla.qk_rope_head_dim}, got {self.head_dim}) and every head has its own "
                                       f"key and value (num_kv_heads = num_heads = {self.num_heads}, got "
                                       f"{self.num_kv_heads})")
            if len(self.dsa.indexer_types) != self.num_layers:
                raise ModelFormatError(f"indexer_types has {len(self.dsa.indexer_types)} entries for "
                                       f"{self.num_layers} layers")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with routed experts (none for a dense model)."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.moe.dense_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with a dense MLP (every layer of a dense model)."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """The layers that run DSA's indexer (the others reuse the previous one's top-k)."""
        return () if self.dsa is None else tuple(i for i, t in enumerate(self.dsa.indexer_types) if t == "full")

    @property
    def cache_entries(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """What a KV cache holds per token and layer in its k and v, as (heads, width): GQA's keys and
        values; MLA's [latent ‖ rotary key] (one vector) and DSA's indexer key."""
        if self.mla is None:
            return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)
        return (1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim), (1, self.dsa.index_head_dim)

    @property
    def v_head_dim(self) -> int:
        """The width of one head's value (and of its attention output)."""
        return self.head_dim if self.mla is None else self.mla.v_head_dim

    @property
    def architecture(self) -> str:
        return _ARCHITECTURES[self.family]

    # ------------------------------------------------------------------ Hugging Face config.json
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed Hugging Face `config.json`; `source` names the file in errors."""
        family = hf.get("model_type")
        if family is None:
            archs = hf.get("architectures") or []
            family = next((_FAMILY_OF_ARCHITECTURE[a] for a in archs if a in _FAMILY_OF_ARCHITECTURE), None)
        if family is None:
            raise ModelFormatError(f"{source}: no 'model_type' or known 'architectures' entry; "
                                   f"supported model types: {', '.join(FAMILIES)}")
        if family not in FAMILIES:
            raise ModelFormatError(f"{source}: model_type {family!r} is not supported; "
                                   f"supported: {', '.join(FAMILIES)}")

        def need(key: str) -> Any:
            if key not in hf:
                raise ModelFormatError(f"{source}: required field {key!r} is missing")
            return hf[key]

        if hf.get("mlp_bias"):
            raise ModelFormatError(f"{source}: mlp_bias=true is not supported")
        if hf.get("use_sliding_window"):
            raise ModelFormatError(f"{source}: use_sliding_window=true is not supported")
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        mla, dsa = _parse_mla(hf, family, need("num_hidden_layers"), source)
        if mla is not None and hf.get("attention_bias"):
            raise ModelFormatError(f"{source}: attention_bias=true is not supported for {family}")
        head_dim = hf.get("head_dim") if mla is None else mla.qk_rope_head_dim
        if head_dim is None and isinstance(hidden, int) and isinstance(num_heads, int) and num_heads > 0:
            head_dim = hidden // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        num_layers = need("num_hidden_layers")
        moe = _parse_moe(hf, family, num_layers, source)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = hf.get("rope_theta")
        rope_parameters = hf.get("rope_parameters") or {}  # transformers >= 5 nests them here
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta", 10000.0)
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_heads if mla is not None else hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_parse_rope_scaling(hf.get("rope_scaling") or rope_parameters, source),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **family_defaults(family, attention_bias, bool(hf.get("use_qk_norm", False))),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            partial_rotary_factor=float(hf.get("partial_rotary_factor", rope_parameters.get("partial_rotary_factor",
                                                                                         1.0))),
            moe=moe,
            mla=mla,
            dsa=dsa,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelFormatError(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(hf, dict):
            raise ModelFormatError(f"{path}: expected a JSON object")
        return cls.from_hf_dict(hf, source=str(path))

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """The `config.json` transformers and SGLang read for this architecture."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype,
            "dtype": dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else (self.eos_token_ids[0] if self.eos_token_ids else None)),
        }
        if self.family == "qwen2":
            hf["use_sliding_window"] = False
        else:
            hf["attention_bias"] = self.qkv_bias
        if self.partial_rotary_factor != 1.0:
            hf["partial_rotary_factor"] = self.partial_rotary_factor
        if self.moe is not None:
            hf.update(_moe_to_hf(self))
        if self.mla is not None:
            hf.update(_mla_to_hf(self))
        if self.rope_scaling is not None:
            s = self.rope_scaling
            hf["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
            if s.kind == "llama3":
                hf["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                          original_max_position_embeddings=s.original_max_position_embeddings)
        return hf


# config.json keys of each MoE family this model reads (others that name experts or routing are refused)
_MOE_KEYS = {
    "qwen3_moe": {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"},
    "glm4_moe": {"n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "norm_topk_prob", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
                 "first_k_dense_replace", "num_nextn_predict_layers", "router_aux_loss_coef", "output_router_logits"},
}
# GLM-5: GLM-4.5's experts, its MLP kinds listed per layer, and DSA's indexer keys
_MOE_KEYS["glm_moe_dsa"] = _MOE_KEYS["glm4_moe"] | {"mlp_layer_types", "index_topk", "index_topk_freq",
                                                   "index_skip_topk_offset", "index_topk_pattern"}
_MOE_WORDS = ("expert", "moe", "topk", "router", "routed", "scoring", "n_group", "dense_replace", "sparse")


def _parse_moe(hf: dict[str, Any], family: str, num_layers: int, source: str) -> MoEConfig | None:
    if family not in MOE_FAMILIES:
        return None
    unknown = sorted(k for k in hf if any(w in k for w in _MOE_WORDS) and k not in _MOE_KEYS[family])
    if unknown:
        raise ModelFormatError(f"{source}: MoE option {unknown[0]!r} is not supported for {family}"
                               + (f" (nor {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""))

    def need(*keys: str) -> Any:
        for key in keys:
            if key in hf:
                return hf[key]
        raise ModelFormatError(f"{source}: required MoE field {keys[0]!r} is missing")

    experts = need("num_experts", "num_local_experts", "n_routed_experts")
    try:
        if family == "qwen3_moe":
            step = int(hf.get("decoder_sparse_step", 1))
            only = set(hf.get("mlp_only_layers") or [])
            dense = tuple(i for i in range(num_layers) if i in only or experts <= 0 or step <= 0 or (i + 1) % step)
            return MoEConfig(num_experts=experts, experts_per_token=need("num_experts_per_tok"),
                             intermediate_size=need("moe_intermediate_size"), router="softmax",
                             norm_topk_prob=bool(hf.get("norm_topk_prob", False)), dense_layers=dense)
        first_dense = min(int(hf.get("first_k_dense_replace", 0)), num_layers)
        dense = tuple(range(first_dense))
        if family == "glm_moe_dsa" and hf.get("mlp_layer_types") is not None:
            kinds = list(hf["mlp_layer_types"])
            if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
                raise ModelFormatError(f"{source}: mlp_layer_types must name 'dense' or 'sparse' for each of the "
                                       f"{num_layers} layers, got {kinds}")
            dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
        return MoEConfig(num_experts=experts, experts_per_token=need("num_experts_per_tok"),
                         intermediate_size=need("moe_intermediate_size"), router="sigmoid",
                         norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                         routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                         n_group=int(hf.get("n_group", 1)), topk_group=int(hf.get("topk_group", 1)),
                         score_correction_bias=True, num_shared_experts=int(hf.get("n_shared_experts", 0)),
                         dense_layers=dense)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{source}: {e}") from None


def _moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    m = config.moe
    shared = {"num_experts_per_tok": m.experts_per_token, "moe_intermediate_size": m.intermediate_size,
              "norm_topk_prob": m.norm_topk_prob}
    if config.family == "qwen3_moe":
        return {**shared, "num_experts": m.num_experts, "decoder_sparse_step": 1,
                "mlp_only_layers": list(m.dense_layers)}
    first = len(m.dense_layers)
    glm5 = {"mlp_layer_types": ["dense" if i in m.dense_layers else "sparse" for i in range(config.num_layers)]}
    if config.family == "glm_moe_dsa":  # its MLP kinds are listed per layer: any pattern
        return {**shared, "n_routed_experts": m.num_experts, "n_shared_experts": m.num_shared_experts,
                "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.n_group, "topk_group": m.topk_group,
                "first_k_dense_replace": first if m.dense_layers == tuple(range(first)) else 0, **glm5}
    if m.dense_layers != tuple(range(first)):
        raise ModelFormatError(f"glm4_moe keeps its dense layers first; dense layers {list(m.dense_layers)} "
                               f"cannot be written as first_k_dense_replace")
    return {**shared, "n_routed_experts": m.num_experts, "n_shared_experts": m.num_shared_experts,
            "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.n_group, "topk_group": m.topk_group,
            "first_k_dense_replace": first, "use_qk_norm": config.qk_norm, "num_nextn_predict_layers": 0}


def _parse_mla(hf: dict[str, Any], family: str, num_layers: Any, source: str
               ) -> tuple[MLAConfig | None, DSAConfig | None]:
    """GLM-5's latent attention and indexer from its config.json (None, None for other families)."""
    if family not in MLA_FAMILIES:
        return None, None

    def need(key: str) -> Any:
        if key not in hf:
            raise ModelFormatError(f"{source}: required field {key!r} is missing")
        return hf[key]

    if hf.get("q_lora_rank") is None:
        raise ModelFormatError(f"{source}: q_lora_rank is null: {family} needs a low-rank query (q_a_proj, q_b_proj)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelFormatError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported for "
                               f"{family}; supported: default")
    types = hf.get("indexer_types")
    if types is None:  # transformers' schedule: every `freq`-th layer from `offset` runs the indexer
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        else:
            freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(int(num_layers))]
    try:
        mla = MLAConfig(q_lora_rank=need("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"),
                        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
                        v_head_dim=need("v_head_dim"))
        dsa = DSAConfig(index_topk=need("index_topk"), index_head_dim=need("index_head_dim"),
                        index_n_heads=need("index_n_heads"), indexer_types=tuple(types))
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{source}: {e}") from None
    return mla, dsa


def _mla_to_hf(config: ModelConfig) -> dict[str, Any]:
    m, d = config.mla, config.dsa
    return {"q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "index_topk": d.index_topk,
            "index_head_dim": d.index_head_dim, "index_n_heads": d.index_n_heads,
            "indexer_types": list(d.indexer_types), "attention_bias": False, "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}


def _parse_rope_scaling(raw: dict[str, Any] | None, source: str) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise ModelFormatError(f"{source}: rope_scaling type {kind!r} is not supported; supported: llama3, linear")
    try:
        factor = float(raw["factor"])
    except (KeyError, TypeError, ValueError):
        raise ModelFormatError(f"{source}: rope_scaling.factor is missing or not a number") from None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    return RopeScaling(
        kind="llama3", factor=factor,
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
