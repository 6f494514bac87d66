"""Growing a student: deeper and wider models that start as exactly their base (logits equal on
random tokens), with the shapes asked for; the symmetry-breaking noise moves them only a little;
what cannot be grown is refused by name."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from opd_jax.models import Decoder, ModelConfig
from opd_jax.models.grow import grow
from opd_jax.models.moe import MoEConfig

CONFIG = ModelConfig(family="llama", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=64)


def logits(model, tokens):
    return np.asarray(model(jnp.asarray(tokens)), np.float64)


@pytest.mark.parametrize("config", [CONFIG, dataclasses.replace(CONFIG, family="qwen2", qkv_bias=True,
                                                                  tie_word_embeddings=True)], ids=["llama", "qwen2-tied"])
def test_a_grown_model_computes_its_bases_function(config):
    base = Decoder(config, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (3, 11))
    reference = logits(base, tokens)
    for layers, width in [(5, None), (None, 80), (7, 100)]:
        grown = grow(base, num_layers=layers, intermediate_size=width)
        assert grown.config.num_layers == (layers or 3) and grown.config.intermediate_size == (width or 48)
        np.testing.assert_allclose(logits(grown, tokens), reference, atol=2e-5, rtol=1e-5)
    # the added layers copy trained ones (their inputs are useful), with zero outputs
    grown = grow(base, num_layers=6)
    q, o = np.asarray(grown.backbone.layers.q[...]), np.asarray(grown.backbone.layers.o[...])
    np.testing.assert_array_equal(q[1], q[0])
    assert not np.any(o[1]) and np.any(o[0])
    # noise breaks the copies' symmetry and moves the function only a little
    noisy = grow(base, intermediate_size=96, noise=1e-2, seed=1)
    gate = np.asarray(noisy.backbone.layers.gate[...])
    assert not np.allclose(gate[..., 48:], gate[..., :48])
    assert np.abs(logits(noisy, tokens) - reference).max() < 1e-2


def test_what_cannot_be_grown_is_refused():
    base = Decoder(CONFIG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cannot be smaller than its base: 2 layers"):
        grow(base, num_layers=2)
    moe = dataclasses.replace(CONFIG, family="qwen3_moe", moe=MoEConfig(num_experts=4, experts_per_token=2,
                                                                       intermediate_size=16))
    with pytest.raises(ValueError, match="mixture-of-experts student is not supported"):
        grow(Decoder(moe, rngs=nnx.Rngs(0)), num_layers=4)
