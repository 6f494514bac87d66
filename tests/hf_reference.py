"""Tiny randomly initialised transformers models, saved to disk: the parity references."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)

FAMILY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False),
    "llama_tied_scaled": lambda: transformers.LlamaConfig(
        **TINY, rope_theta=50000.0, tie_word_embeddings=True, attention_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True),
    # Qwen3-MoE: softmax top-3 of 8 without renormalisation, every second layer routed
    # (decoder_sparse_step 2: layers 1 and 3) except those in mlp_only_layers (3), q/k/v/o biases
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **{**TINY, "num_hidden_layers": 4}, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3], attention_bias=True,
        tie_word_embeddings=False),
    # GLM-4.5: sigmoid router with a selection bias, 4 groups of 2 experts (best 2 groups eligible),
    # renormalised gates × 2.5, one shared expert, the first layer dense, half-rotary heads, q/k norm,
    # q/k/v biases
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **{**TINY, "num_hidden_layers": 3}, head_dim=16, partial_rotary_factor=0.5, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5, n_group=4,
        topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        num_nextn_predict_layers=0, tie_word_embeddings=False),
    # GLM-5: MLA (low-rank query, compressed key/value, a shared rotary key), DSA keeping 8 keys per
    # query (below the tests' longer sequences, so the sparsity matters), the indexer run in layers
    # 0 and 2 and reused in 1 and 3, GLM-4.5's router and shared expert, the second layer dense
    # (mlp_layer_types: a pattern first_k_dense_replace cannot write)
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(
        **{**TINY, "num_hidden_layers": 4, "num_key_value_heads": 4}, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, index_topk=8, index_head_dim=32, index_n_heads=16,
        indexer_types=["full", "shared", "full", "shared"], n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"], norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
MODEL_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                 "glm4_moe": transformers.Glm4MoeForCausalLM, "glm_moe_dsa": transformers.GlmMoeDsaForCausalLM}


def make_hf_model(kind: str, directory: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny HF model with random weights (norms and biases randomised too), saved to `directory`."""
    config = FAMILY_CONFIGS[kind]()
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases: away from their 1/0 init so a missed one shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
            elif "gate" in name and p.ndim == 2 and "proj" not in name:  # routers: decisive, so a tie never decides
                p.copy_(0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM's selection-only bias
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(directory)
    return model


def hf_logits(model: transformers.PreTrainedModel, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(tokens), **kwargs).logits.float().numpy()
