"""The routers' auxiliary losses and metrics of a MoE forward pass, for every step that trains a
MoE policy (PPO, the supervised warm start). Pure."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from opd_jax.core.metrics import Maxed
from opd_jax.models.moe import RouterInfo, load_balancing_loss


def router_losses(router: RouterInfo, balance_coef: float, z_coef: float, layers: tuple[int, ...]
                  ) -> tuple[jax.Array, dict[str, Any]]:
    """balance_coef · E·Σ_e f̄_e·P̄_e + z_coef · mean over layers of the z-loss, and the routers'
    metrics: both losses, and per MoE layer (`layers`: their indices in the model) the max/mean
    expert load (1: perfectly balanced; E/k: every token on the same k experts), the worst
    layer's as moe/max_load, and the fraction of tokens whose top-k set differs from the
    engine's (flip_frac; 0 without an engine routing in the batch). A DSA model's indexers: per
    indexer layer the fraction of tokens whose top-k key set differs from the engine's
    (dsa/flip_frac). No MoE layer (a DSA model's RouterInfo only): no router loss."""
    metrics: dict[str, Any] = {}
    if router.index_flips is not None:
        metrics["dsa/flip_frac"] = jnp.mean(router.index_flips)
        metrics.update({f"dsa/indexer{i}/flip_frac": router.index_flips[i] for i in range(router.index_flips.shape[0])})
    if not layers:
        return jnp.zeros((), jnp.float32), metrics
    balance = load_balancing_loss(router.tokens_per_expert, router.prob_per_expert)
    z = jnp.mean(router.z_loss)
    f = router.tokens_per_expert  # [layers, E], each row sums to k
    max_load = jnp.max(f, axis=-1) / jnp.maximum(jnp.mean(f, axis=-1), 1e-9)
    metrics.update({"moe/balance_loss": balance, "moe/z_loss": z, "moe/max_load": Maxed(jnp.max(max_load)),
                    "moe/flip_frac": jnp.mean(router.flip_fraction)})
    metrics.update({f"moe/layer{layer}/max_load": Maxed(max_load[i]) for i, layer in enumerate(layers)})
    metrics.update({f"moe/layer{layer}/flip_frac": router.flip_fraction[i] for i, layer in enumerate(layers)})
    return balance_coef * balance + z_coef * z, metrics
