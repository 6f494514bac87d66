"""Forward passes of a decoder (and a critic) over a RolloutBatch, as the steps and the scoring
passes need them: logits, per-token log-probs (and entropies), critic values. Pure; PPO, OPD and
SFT all build on these, so none of them depends on another.

All outputs line up with batch.tokens [B, T]: position t holds what the model says of tokens[t]
given tokens[:t] (`token_logprobs`, `shift_right`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.core.batch import RolloutBatch
from opd_jax.core.distributions import shift_right, token_logprobs
from opd_jax.core.update import map_rows
from opd_jax.models.moe import RouterInfo


def sequence_logits(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *, unroll: int | bool = 1,
                    temperature: float = 1.0, with_router: bool = False, replay: bool = False
                    ) -> jax.Array | tuple[jax.Array, RouterInfo | None]:
    """logits / temperature of the decoder (graphdef, params) on batch.tokens: [B, T, V] (with
    with_router, also what a MoE model's routers did, None for a dense model). A batch with the
    engine's routing (batch.routing) is compared with the model's own (the flip fraction) and,
    with replay, used for every token the engine routed (R3)."""
    logits, router = nnx.merge(graphdef, params)(batch.tokens, positions=batch.positions,
                                                 attention_mask=batch.attention_mask, unroll=unroll,
                                                 routing=batch.routing, replay=jnp.asarray(replay),
                                                 return_routing=True)
    logits = logits / temperature if temperature != 1.0 else logits
    return (logits, router) if with_router else logits


def sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *,
                      with_entropy: bool = False, unroll: int | bool = 1, temperature: float = 1.0,
                      with_router: bool = False, replay: bool = False) -> tuple[jax.Array, ...]:
    """Per-token log-probs (and entropies) of batch.tokens under the decoder (graphdef, params),
    of the distribution softmax(logits / temperature):

        logp[b, t] = log softmax(logits[b, t−1] / T)[tokens[b, t]]

    Returns (logp, entropy or None), and with with_router the RouterInfo (None for dense)."""
    logits, router = sequence_logits(graphdef, params, batch, unroll=unroll, temperature=temperature,
                                     with_router=True, replay=replay)
    logp, entropy = token_logprobs(logits, batch.tokens, with_entropy=with_entropy)
    return (logp, entropy, router) if with_router else (logp, entropy)


def sequence_values(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *,
                    unroll: int | bool = 1) -> jax.Array:
    """V(tokens[:t]) at each position t: the critic's output on the prefix before token t."""
    return shift_right(_values(graphdef, params, batch, unroll))


def _values(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, unroll: int | bool = 1) -> jax.Array:
    return nnx.merge(graphdef, params)(batch.tokens, positions=batch.positions, attention_mask=batch.attention_mask,
                                       unroll=unroll)


def values_and_final(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch) -> tuple[jax.Array, jax.Array]:
    """`sequence_values` [B, T] and the value of each whole row, V(tokens[:n]) with n the row's
    real tokens [B]: where a truncated episode stopped, for bootstrapping."""
    values = _values(graphdef, params, batch)
    last = jnp.maximum(jnp.sum(batch.attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    return shift_right(values), jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


def policy_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *, temperature: float = 1.0,
                    microbatches: int = 1, replay: bool = False) -> jax.Array:
    """Per-token log-probs under fixed parameters, at softmax(logits / temperature), in
    `microbatches` slices, zero off the response mask: θ_old of PPO and OPD, or a frozen
    reference for the KL term. replay: a MoE model uses the engine's routing (R3)."""
    logp = map_rows(lambda b: sequence_logprobs(graphdef, params, b, temperature=temperature, replay=replay)[0],
                    batch, microbatches)
    return jnp.where(batch.response_mask > 0, logp, 0.0)
