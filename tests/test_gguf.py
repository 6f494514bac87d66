"""GGUF files, read by opd_jax and by transformers' own GGUF loader, give the same model."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf_writer import write_gguf
from hf_reference import hf_logits, make_hf_model

from opd_jax.models import ModelFormatError, load_model


def transformers_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("kind,qtype", [("llama", gguf.GGMLQuantizationType.F32),
                                        ("llama", gguf.GGMLQuantizationType.Q8_0),
                                        ("qwen2", gguf.GGMLQuantizationType.F16),
                                        ("llama", gguf.GGMLQuantizationType.Q4_1)])
def test_written_gguf_matches_transformers_gguf_loader(tmp_path, kind, qtype):
    hf = make_hf_model(kind, tmp_path / "hf")
    path = write_gguf(hf, tmp_path / f"{kind}.gguf", qtype)
    ours, tokenizer = load_model(path)
    assert tokenizer is None  # this file carries no vocabulary
    tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 9)).astype(np.int32)
    ref = hf_logits(transformers_gguf(path), tokens)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4 * np.abs(ref).max())
    if qtype == gguf.GGMLQuantizationType.F32:  # lossless: also equals the original checkpoint
        np.testing.assert_allclose(ref, hf_logits(hf, tokens), atol=1e-5 * np.abs(ref).max())


def test_qwen3_gguf_with_wide_heads_matches_original(tmp_path):
    """head_dim (32) != hidden/heads (16) comes from attention.key_length, which transformers'
    GGUF loader ignores; the lossless F32 file is checked against the original checkpoint."""
    hf = make_hf_model("qwen3", tmp_path / "hf")
    ours, _ = load_model(write_gguf(hf, tmp_path / "qwen3.gguf"))
    assert ours.config.head_dim == 32 and ours.config.qk_norm
    tokens = np.random.default_rng(1).integers(0, hf.config.vocab_size, (2, 9)).astype(np.int32)
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4 * np.abs(ref).max())


def test_truncated_gguf_is_a_clear_error(tmp_path):
    hf = make_hf_model("llama", tmp_path / "hf")
    path = write_gguf(hf, tmp_path / "full.gguf")
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 200):
        cut_path = tmp_path / f"cut{cut}.gguf"
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match=r"cut\d+\.gguf: GGUF file is truncated"):
            load_model(cut_path)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + data[4:100])
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_model(not_gguf)
