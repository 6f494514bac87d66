"""Write a tiny transformers model as a GGUF file the way llama.cpp's converter does (tensor
names, metadata keys, and the Q/K row permutation for `llama`), so GGUF reading is tested on more
families and quantisations than the one pretrained file we have."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
          "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model, path: Path, qtype=gguf.GGMLQuantizationType.F32) -> Path:
    c = hf_model.config
    arch = c.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{_NAMES[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                w = _llama_cpp_permute(w, c.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                w = _llama_cpp_permute(w, c.num_key_value_heads)
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and w.shape[1] % 32 == 0:
            writer.add_tensor(out, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(out, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
