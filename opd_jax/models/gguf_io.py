"""Reading llama.cpp GGUF files: architecture metadata, dequantised weights, and the tokenizer.

The tensors are renamed to their Hugging Face names, so a GGUF goes through the same shape checks
and layout conversion as a safetensors checkpoint. llama.cpp's converter permutes the rows of the
Q and K projections of `llama` models (for its interleaved rotary layout); that is undone here.
Any quantisation the `gguf` package can dequantise (Q4_0/1, Q5_x, Q8_0, K-quants, F16, BF16) loads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from opd_jax.models.config import FAMILIES, ModelConfig, ModelFormatError, RopeScaling
from opd_jax.models.tokenizer import Tokenizer

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# How each `tokenizer.ggml.pre` splits text before byte-level BPE (the pattern its merges were
# learned with). Anything else uses the GPT-2 pattern built into the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                         "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


def _open(path: Path) -> gguf.GGUFReader:
    if not path.exists():
        raise ModelFormatError(f"{path}: file not found")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file (bad magic number)")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader fails with assorted numpy/struct errors on a cut file
        raise ModelFormatError(f"{path}: GGUF file is truncated or corrupt ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelFormatError(f"{path}: GGUF file is truncated: tensor {t.name!r} has "
                                   f"{t.data.nbytes} of its {t.n_bytes} bytes")
    return reader


def _field(reader: gguf.GGUFReader, key: str, default: Any = None, *, path: Path | None = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if path is not None:
            raise ModelFormatError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _config(reader: gguf.GGUFReader, path: Path, tensor_names: set[str]) -> ModelConfig:
    arch = _field(reader, "general.architecture", path=path)
    if arch not in FAMILIES:
        raise ModelFormatError(f"{path}: GGUF architecture {arch!r} is not supported; "
                               f"supported: {', '.join(FAMILIES)}")
    if "rope_freqs.weight" in tensor_names:
        raise ModelFormatError(f"{path}: per-dimension rope frequency factors (rope_freqs) are not supported")
    meta = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    need = lambda key: _field(reader, f"{arch}.{key}", path=path)  # noqa: E731
    hidden, heads = need("embedding_length"), need("attention.head_count")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = meta("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ModelFormatError(f"{path}: GGUF has neither {arch}.vocab_size nor a tokenizer vocabulary")
    scaling = None
    if meta("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(meta("rope.scaling.factor")))
    elif meta("rope.scaling.type") not in (None, "none"):
        raise ModelFormatError(f"{path}: rope scaling {meta('rope.scaling.type')!r} is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=arch, vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
        num_heads=int(heads), num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names, o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm=arch == "qwen3",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise ModelFormatError(f"{path}: GGUF tensor {name!r} is not part of a supported decoder")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute`: rows (head, pair, half) back to (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """(config, HF-named float32 tensors, tokenizer or None) from a GGUF file."""
    path = Path(path)
    reader = _open(path)
    by_name = {t.name: t for t in reader.tensors}
    config = _config(reader, path, set(by_name))
    tensors: dict[str, np.ndarray] = {}
    for name, t in by_name.items():
        hf = _hf_name(name, path)
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise ModelFormatError(f"{path}: tensor {name!r}: cannot dequantise {t.tensor_type.name} ({e})") from None
        if config.family == "llama" and hf.endswith("q_proj.weight"):
            w = _unpermute(w, config.num_heads)
        elif config.family == "llama" and hf.endswith("k_proj.weight"):
            w = _unpermute(w, config.num_kv_heads)
        tensors[hf] = w
    return config, tensors, gguf_tokenizer(reader, path)


def read_gguf_config(path: str | Path) -> tuple[ModelConfig, Tokenizer | None]:
    """(config, tokenizer or None) of a GGUF file, its tensors left unread."""
    path = Path(path)
    reader = _open(path)
    return _config(reader, path, {t.name for t in reader.tensors}), gguf_tokenizer(reader, path)


def gguf_tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer | None:
    """The byte-level BPE tokenizer a GGUF describes (vocab, merges, special tokens, template)."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise ModelFormatError(f"{path}: GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens", path=path)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", path=path)]
    types = _field(reader, "tokenizer.ggml.token_type", [])
    backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                              fuse_unk=False, byte_fallback=False))
    split = _PRE_TOKENIZER_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special; user-defined ones stay whole but are plain text.
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel and is skipped.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    token_at = lambda key: (tokens[i] if (i := _field(reader, key)) is not None and i < len(tokens) else None)  # noqa: E731
    bos = token_at("tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
    return Tokenizer(backend=backend, bos_token=bos, eos_token=token_at("tokenizer.ggml.eos_token_id"),
                     pad_token=token_at("tokenizer.ggml.padding_token_id"),
                     chat_template=_field(reader, "tokenizer.chat_template"))
