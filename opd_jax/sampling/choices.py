"""What an engine records of each token's discrete choices, for replay in the trainer: a MoE
model's experts (routing replay, R3) and a DSA model's attended keys (index replay), as one dict
per token range, {"experts": [..., MoE layers, k], "indices": [..., indexer layers, index_topk]}
(-1: none). The keys as offsets back from the token (`models.mla.key_offsets`), so a record
means the same in the engine's cache and in the trainer's rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.models.config import ModelConfig
from opd_jax.models.moe import RouterInfo

# a record's name -> the Rollout field that carries it
FIELDS = {"experts": "routed_experts", "indices": "index_offsets"}


def choice_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The per-token shape of each choice the model makes (none for a dense model without DSA)."""
    shapes = {}
    if config.moe is not None and config.moe_layers:
        shapes["experts"] = (len(config.moe_layers), config.moe.experts_per_token)
    if config.dsa is not None:
        shapes["indices"] = (len(config.indexer_layers), config.dsa.index_topk)
    return shapes


def recorded_choices(config: ModelConfig, info: RouterInfo | None, tokens: tuple[int, int]) -> dict[str, jax.Array]:
    """The choices of a forward over `tokens` [B, T] from its RouterInfo; a DSA model's keys are
    all -1 where it attended every key (its cache no longer than its top-k): nothing was chosen."""
    out = {}
    for name, shape in choice_shapes(config).items():
        got = None if info is None else info.ids if name == "experts" else info.index_offsets
        out[name] = jnp.full((*tokens, *shape), -1, jnp.int32) if got is None else got.astype(jnp.int32)
    return out


def as_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A record as the Rollout's fields (routed_experts, index_offsets)."""
    return {FIELDS[name]: np.asarray(value) for name, value in record.items()}


def of_fields(holder: Any) -> dict[str, np.ndarray]:
    """The record a Rollout (or anything with its fields) carries."""
    return {name: np.asarray(getattr(holder, field)) for name, field in FIELDS.items()
            if getattr(holder, field, None) is not None}
