"""Mixture-of-experts feed-forward: routing (Qwen3-MoE's softmax top-k, GLM-4.5's sigmoid
group-limited top-k with a selection-only bias), expert dispatch as grouped matmuls over tokens
sorted by expert (`jax.lax.ragged_dot`), and a dense reference that computes every expert on every
token (the test oracle, never the model's path).

Routing replay (R3): `route(..., forced=ids)` keeps the given expert ids and recomputes their
gates from this model's own router scores, so a trainer can use exactly the experts an engine
used while its gradients still reach the router.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import chex
import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The experts of a MoE model (one per sparse layer), and how tokens are routed to them."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # of each routed expert
    router: Literal["softmax", "sigmoid"] = "softmax"  # Qwen3-MoE: softmax; GLM-4.5: sigmoid
    norm_topk_prob: bool = False  # renormalise the k gates to sum to 1
    routed_scaling_factor: float = 1.0  # GLM-4.5: gates × this
    n_group: int = 1  # GLM-4.5: experts in n_group groups; only the best topk_group groups are eligible
    topk_group: int = 1
    score_correction_bias: bool = False  # GLM-4.5: a per-expert bias added to the scores for selection only
    num_shared_experts: int = 0  # GLM-4.5: a dense MLP of num_shared × intermediate_size added to every token
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (intermediate_size of the model) instead

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be in [1, num_experts "
                             f"({self.num_experts})]")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and topk_group "
                             f"({self.topk_group}) be in [1, n_group]")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be softmax or sigmoid, got {self.router!r}")


def route(logits: jax.Array, config: MoEConfig, bias: jax.Array | None = None,
          forced: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(expert ids [N, k] int32, gates [N, k] float32) from router logits [N, E].

    softmax:  p = softmax(logits); ids = top-k(p); g = p[ids] (÷ Σ g if norm_topk_prob)
    sigmoid:  s = σ(logits); c = s + bias (selection only); groups of E/n_group experts scored by
              the sum of their 2 best c; ids = top-k(c) over the topk_group best groups;
              g = s[ids] (÷ (Σ g + 1e-20) if norm_topk_prob) · routed_scaling_factor
    forced: ids [N, k] to use instead of the selection (routing replay); gates as above at them.
    """
    chex.assert_rank(logits, 2)
    logits = logits.astype(jnp.float32)
    E, k = config.num_experts, config.experts_per_token
    if config.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores + (bias.astype(jnp.float32) if bias is not None else 0.0)
        if config.n_group > 1:
            grouped = choice.reshape(-1, config.n_group, E // config.n_group)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, n_group]
            best = jax.lax.top_k(group_score, config.topk_group)[1]
            keep = jnp.zeros_like(group_score, bool).at[jnp.arange(group_score.shape[0])[:, None], best].set(True)
            choice = jnp.where(jnp.repeat(keep, E // config.n_group, axis=-1), choice, -jnp.inf)
    ids = jax.lax.top_k(choice, k)[1] if forced is None else forced.astype(jnp.int32)
    chex.assert_shape(ids, (logits.shape[0], k))
    gates = jnp.take_along_axis(scores, ids, axis=-1)
    if config.norm_topk_prob:
        gates = gates / (gates.sum(-1, keepdims=True) + (1e-20 if config.router == "sigmoid" else 0.0))
    return ids.astype(jnp.int32), gates * config.routed_scaling_factor


def experts_ragged(x: jax.Array, ids: jax.Array, gates: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array) -> jax.Array:
    """Σ_j gates[n, j] · SwiGLU_{ids[n, j]}(x[n]) for x [N, H], with expert weights gate, up
    [E, H, I] and down [E, I, H]: the N·k (token, expert) pairs sorted by expert, each expert's
    rows multiplied by its own weights in one grouped matmul (`ragged_dot`), then scattered back."""
    N, k = ids.shape
    E = gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    rows = x[token]
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(h.astype(x.dtype), down, sizes)
    weighted = out * gates.reshape(-1)[order][:, None].astype(out.dtype)
    return jax.ops.segment_sum(weighted, token, num_segments=N).astype(x.dtype)


def experts_dense(x: jax.Array, ids: jax.Array, gates: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
    """The same sum computed for every expert on every token, weighted by a dense [N, E] gate
    matrix (zero off the chosen experts): the oracle `experts_ragged` is tested against."""
    weights = jnp.zeros((x.shape[0], gate.shape[0]), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(gates)
    every = jnp.einsum("nei,eih->neh", jax.nn.silu(jnp.einsum("nh,ehi->nei", x, gate))
                       * jnp.einsum("nh,ehi->nei", x, up), down)
    return jnp.einsum("ne,neh->nh", weights.astype(every.dtype), every).astype(x.dtype)


def tokens_per_expert(ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
    """f_e: the fraction of the valid tokens that chose expert e among their k, [E] (sums to k)."""
    counts = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum(1)  # [N, E]
    w = jnp.ones(ids.shape[0], jnp.float32) if valid is None else valid.astype(jnp.float32)
    return (counts * w[:, None]).sum(0) / jnp.maximum(w.sum(), 1.0)


def prob_per_expert(logits: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """P_e: the mean over the valid tokens of softmax(logits)_e, [E]."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w = jnp.ones(probs.shape[0], jnp.float32) if valid is None else valid.astype(jnp.float32)
    return (probs * w[:, None]).sum(0) / jnp.maximum(w.sum(), 1.0)


def load_balancing_loss(f: jax.Array, P: jax.Array) -> jax.Array:
    """Switch-Transformer auxiliary loss as transformers computes it (Qwen3-MoE, Mixtral):
    E · Σ_e f̄_e · P̄_e, with f (`tokens_per_expert`) and P (`prob_per_expert`) [layers, E]
    averaged over the layers first (transformers pools the layers' tokens)."""
    return f.shape[-1] * jnp.sum(f.reshape(-1, f.shape[-1]).mean(0) * P.reshape(-1, P.shape[-1]).mean(0))


def router_z_loss(logits: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: mean over valid tokens of logsumexp(logits)²."""
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2
    w = jnp.ones_like(z) if valid is None else valid.astype(jnp.float32)
    return (z * w).sum() / jnp.maximum(w.sum(), 1.0)


@flax.struct.dataclass
class RouterInfo:
    """What the routers of a forward pass did, per MoE layer: the expert ids of every token
    [B, T, layers, k], and over the valid tokens f_e (`tokens_per_expert`) and P_e
    (`prob_per_expert`) [layers, E] and the z-loss [layers]."""

    ids: jax.Array
    tokens_per_expert: jax.Array
    prob_per_expert: jax.Array
    z_loss: jax.Array
    flip_fraction: jax.Array  # [layers]: of the tokens with an engine routing, those whose top-k set differs
    # DSA (`models.mla`): each indexer layer's own top-k per token as offsets back [B, T, indexer layers, k]
    # (-1: none), and of the tokens with an engine record, those whose set differs [indexer layers]
    index_offsets: jax.Array | None = None
    index_flips: jax.Array | None = None
    # training the indexers (`index_loss`): per indexer layer, [Σ KL to the attention, queries] [indexer layers, 2]
    index_kl: jax.Array | None = None


def router_stats(logits: jax.Array, ids: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(f [E], P [E], z-loss) of one layer's routing over the valid tokens."""
    E = logits.shape[-1]
    return tokens_per_expert(ids, E, valid), prob_per_expert(logits, valid), router_z_loss(logits, valid)


def flip_fraction(own: jax.Array, engine: jax.Array, available: jax.Array) -> jax.Array:
    """Of the tokens with an engine routing (`available` [N]), the fraction whose top-k expert set
    under this model (`own` [N, k]) differs from the engine's (`engine` [N, k])."""
    differs = jnp.any(jnp.sort(own, -1) != jnp.sort(engine, -1), axis=-1) & available
    return differs.sum() / jnp.maximum(available.sum(), 1)
