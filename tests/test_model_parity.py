"""The Flax decoder is numerically the transformers model it was loaded from."""

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from hf_reference import FAMILY_CONFIGS, hf_logits, make_hf_model

from opd_jax.models import load_model, save_model

KINDS = list(FAMILY_CONFIGS)


def assert_close_rel(ours, ref, rtol=1e-4):
    scale = np.max(np.abs(ref))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rtol * scale)


@pytest.fixture(scope="module", params=KINDS)
def hf_pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, directory)
    model, tokenizer = load_model(directory, dtype="float32")
    return request.param, hf, model, directory


@pytest.mark.parametrize("batch,length", [(1, 1), (2, 7), (3, 33)])
def test_logits_match_transformers(hf_pair, batch, length):
    _, hf, model, _ = hf_pair
    tokens = np.random.default_rng(length).integers(0, hf.config.vocab_size, (batch, length)).astype(np.int32)
    np.testing.assert_equal(model.config.vocab_size, hf.config.vocab_size)
    assert_close_rel(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf, tokens))


def test_right_padding_does_not_change_real_tokens(hf_pair):
    """Rows of different lengths padded at the end: each row's real positions equal its own forward."""
    _, hf, model, _ = hf_pair
    rng = np.random.default_rng(1)
    lengths = [5, 12, 9]
    tokens = np.zeros((3, 12), np.int32)
    mask = np.zeros((3, 12), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(0, hf.config.vocab_size, n)
        mask[i, :n] = 1
    ours = np.asarray(model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)))
    ref = hf_logits(hf, tokens, mask)
    for i, n in enumerate(lengths):
        assert_close_rel(ours[i, :n], ref[i, :n])
        assert_close_rel(ours[i, :n], hf_logits(hf, tokens[i:i + 1, :n])[0])


def test_save_model_round_trips_through_transformers(hf_pair, tmp_path):
    kind, hf, model, _ = hf_pair
    save_model(model, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.random.default_rng(3).integers(0, hf.config.vocab_size, (2, 10)).astype(np.int32)
    assert_close_rel(hf_logits(reloaded, tokens), hf_logits(hf, tokens), rtol=1e-6)
    again, _ = load_model(tmp_path)
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens))), np.asarray(model(jnp.asarray(tokens))))


def test_sharded_checkpoint_loads(hf_pair, tmp_path):
    _, hf, model, _ = hf_pair
    save_model(model, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.arange(8, dtype=np.int32)[None]
    assert_close_rel(np.asarray(load_model(tmp_path)[0](jnp.asarray(tokens))), hf_logits(reloaded, tokens))


def test_bfloat16_params_track_float32(hf_pair):
    _, hf, _, directory = hf_pair
    model, _ = load_model(directory, dtype="bfloat16")
    assert model.param_dtype == jnp.bfloat16
    tokens = np.random.default_rng(4).integers(0, hf.config.vocab_size, (2, 16)).astype(np.int32)
    ref = hf_logits(hf, tokens)
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert ours.dtype == np.float32
    # bf16 keeps ~3 significant digits; the argmax agrees almost everywhere
    assert np.max(np.abs(ours - ref)) < 0.05 * np.max(np.abs(ref))
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) > 0.9
