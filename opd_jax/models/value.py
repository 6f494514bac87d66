"""The critic: the policy's backbone with a scalar value head on every position (for GAE)."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.models.config import ModelConfig
from opd_jax.models.decoder import Backbone, Decoder
from opd_jax.models.lora import add_adapters
from opd_jax.models.weights import build_from_params


class ValueModel(nnx.Module):
    """values = w · h_t + b for the final hidden state h_t of each position: [B, T] float32."""

    def __init__(self, config: ModelConfig, *, param_dtype: Any = jnp.float32, compute_dtype: Any = None,
                 rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.backbone = Backbone(config, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.value_head = nnx.Param(jnp.zeros((config.hidden_size,), jnp.float32), logical_axes=("embed",))
        self.value_bias = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())
        if config.lora is not None:
            add_adapters(self.backbone.layers, config.lora, rngs)

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, unroll: int | bool = 1,
                 segment_ids: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
        hidden, _ = self.backbone.forward(tokens, positions=positions, attention_mask=attention_mask, unroll=unroll,
                                          segment_ids=segment_ids, dropout_key=dropout_key)
        # The head runs in float32 whatever the backbone's dtype: values feed GAE's long sums.
        return hidden.astype(jnp.float32) @ self.value_head[...] + self.value_bias[...]

    @classmethod
    def from_policy(cls, policy: Decoder, *, head_init: Literal["zero", "small"] = "zero",
                    key: jax.Array | None = None, scale: float = 1e-3) -> ValueModel:
        """A critic whose backbone is a copy of `policy`'s; the head is zero or N(0, scale²)."""
        backbone = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(policy.backbone, nnx.Param)))
        if head_init == "zero":
            head = jnp.zeros((policy.config.hidden_size,), jnp.float32)
        elif head_init == "small":
            if key is None:
                raise ValueError("head_init='small' needs a PRNG key")
            head = scale * jax.random.normal(key, (policy.config.hidden_size,), jnp.float32)
        else:
            raise ValueError(f"head_init must be 'zero' or 'small', got {head_init!r}")
        params = {"backbone": backbone, "value_head": head, "value_bias": jnp.zeros((), jnp.float32)}
        critic = build_from_params(cls, policy.config, params, compute_dtype=policy.backbone.compute_dtype)
        critic.backbone.execution = policy.backbone.execution
        return critic
