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
}
MODEL_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}


def make_hf_model(kind: str, directory: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny HF model with random weights (norms and biases randomised too), saved to `directory`."""
    config = FAMILY_CONFIGS[kind]()
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases: away from their 1/0 init so a missed one shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def hf_logits(model: transformers.PreTrainedModel, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(tokens), **kwargs).logits.float().numpy()
