"""The critic shares the policy's backbone and puts a scalar head on every position."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from hf_reference import hf_logits, make_hf_model

from opd_jax.models import Decoder, ModelConfig, ValueModel, load_model


def test_value_model_from_policy(tmp_path):
    hf = make_hf_model("qwen2", tmp_path)
    policy, _ = load_model(tmp_path)
    tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 7)).astype(np.int32)

    zero = ValueModel.from_policy(policy)
    assert np.all(np.asarray(zero(jnp.asarray(tokens))) == 0)

    critic = ValueModel.from_policy(policy, head_init="small", key=jax.random.key(0), scale=0.1)
    values = np.asarray(critic(jnp.asarray(tokens)))
    assert values.shape == (2, 7) and values.dtype == np.float32
    # reference: transformers' final hidden states through the same linear head
    with torch.no_grad():
        hidden = hf(torch.tensor(tokens), output_hidden_states=True).hidden_states[-1].numpy()
    head = np.asarray(critic.value_head[...])
    np.testing.assert_allclose(values, hidden @ head, atol=1e-4 * np.abs(hidden @ head).max())

    # the backbone is a copy: training the critic never moves the policy
    critic.backbone.embed[...] = critic.backbone.embed[...] + 1.0
    np.testing.assert_allclose(np.asarray(policy(jnp.asarray(tokens))), hf_logits(hf, tokens),
                               atol=1e-4 * np.abs(hf_logits(hf, tokens)).max())
    assert not hasattr(critic, "lm_head")


def test_every_parameter_has_logical_axes_of_its_rank():
    config = ModelConfig(family="qwen3", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=8, qkv_bias=True, o_bias=True, qk_norm=True)
    for module in (ValueModel(config), Decoder(config)):
        params = nnx.state(module, nnx.Param)
        leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        assert leaves
        for var in leaves:
            axes = var.get_metadata()["logical_axes"]
            assert len(axes) == var[...].ndim, (axes, var[...].shape)
