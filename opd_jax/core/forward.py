"""Forward passes of a decoder (and a critic) over a RolloutBatch, as the steps and the scoring
passes need them: logits, per-token log-probs (and entropies), critic values. Pure; PPO, OPD and
SFT all build on these, so none of them depends on another.

All outputs line up with batch.tokens [B, T]: position t holds what the model says of tokens[t]
given tokens[:t] (`token_logprobs`, `shift_right`). A packed batch (batch.packing) runs the model
on its packed rows and maps each per-token output back to [B, T] (`core.packing`): the same
numbers, up to float rounding, for less compute."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.core.batch import RolloutBatch
from opd_jax.core.distributions import chunked_positions, picked_and_entropy, shift_right
from opd_jax.core.packing import pack_tokens, unpack
from opd_jax.core.update import map_rows
from opd_jax.models.moe import RouterInfo

RoutingReplay = Literal["none", "r3"]
"""MoE: r3 scores θ_old and trains with the engine's experts for every token it routed (gates: the
trainer's router); none: the trainer routes on its own."""


def _run(model: nnx.Module, batch: RolloutBatch, unroll: int | bool, **kwargs
         ) -> tuple[Any, jax.Array, Callable[[jax.Array], jax.Array]]:
    """The module on the batch, padded or packed: (its output, the tokens it ran on, and the map
    of a per-token output of that run to the batch's [B, T] layout)."""
    if batch.packing is None:
        out = model(batch.tokens, positions=batch.positions, attention_mask=batch.attention_mask, unroll=unroll,
                    **kwargs)
        return out, batch.tokens, lambda x: x
    if kwargs.get("adapter_ids") is not None:
        raise ValueError("adapter_ids pick an adapter per row: run an unpacked batch (batch.unpacked())")
    valid = batch.attention_mask > 0
    # an engine's records are per token: packed alike (DSA's offsets hold within a segment's columns)
    recorded = {name: kwargs[name] for name in ("routing", "indices") if kwargs.get(name) is not None}
    tokens, positions, segments, packed = pack_tokens(batch.tokens, batch.positions, valid, batch.pack_row,
                                                      batch.pack_offset, batch.packing, extra=recorded)
    kwargs.update(packed)
    out = model(tokens, positions=positions, attention_mask=segments > 0, segment_ids=segments, unroll=unroll,
                **kwargs)
    return out, tokens, lambda x: unpack(x, batch.pack_row, batch.pack_offset, valid, batch.packing)


def _with_ids(router: RouterInfo | None, back: Callable[[jax.Array], jax.Array]) -> RouterInfo | None:
    if router is None:
        return None
    offsets = router.index_offsets
    return dataclasses.replace(router, ids=back(router.ids), index_offsets=None if offsets is None else back(offsets))


def sequence_logits(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *, unroll: int | bool = 1,
                    temperature: float = 1.0, with_router: bool = False, replay: bool = False,
                    adapter_ids: jax.Array | None = None, dropout_key: jax.Array | None = None,
                    index_replay: bool = False) -> jax.Array | tuple[jax.Array, RouterInfo | None]:
    """logits / temperature of the decoder (graphdef, params) on batch.tokens: [B, T, V] (with
    with_router, also what a MoE model's routers did, None for a dense model). A batch with the
    engine's routing (batch.routing) is compared with the model's own (the flip fraction) and,
    with replay, used for every token the engine routed (R3); a DSA model's indexer choices alike
    with the engine's (batch.indices), attended instead with index_replay. adapter_ids [B]: a decoder whose
    adapters are a bank (`models.lora.bank`), the adapter each row runs with. dropout_key: a
    training pass (`training_key`): LoRA adapters drop their inputs as `LoraConfig.dropout` says."""
    (logits, router), _, back = _run(nnx.merge(graphdef, params), batch, unroll, routing=batch.routing,
                                     replay=jnp.asarray(replay), return_routing=True, adapter_ids=adapter_ids,
                                     dropout_key=dropout_key, indices=batch.indices,
                                     replay_indices=jnp.asarray(index_replay))
    logits = back(logits / temperature if temperature != 1.0 else logits)
    return (logits, _with_ids(router, back)) if with_router else logits


def sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *,
                      with_entropy: bool = False, with_router: bool = False, **run: Any) -> tuple[jax.Array, ...]:
    """Per-token log-probs (and entropies) of batch.tokens under the decoder (graphdef, params),
    of the distribution softmax(logits / temperature):

        logp[b, t] = log softmax(logits[b, t−1] / T)[tokens[b, t]]

    Returns (logp, entropy or None), and with with_router the RouterInfo (None for dense). run:
    `sequence_positions`' keywords (unroll, temperature, replay, dropout_key, index_replay,
    index_loss, adapter_ids)."""
    (logp, entropy), router = sequence_positions(graphdef, params, batch,
                                                 functools.partial(picked_and_entropy, with_entropy=with_entropy),
                                                 with_router=True, **run)
    entropy = entropy if with_entropy else None
    return (logp, entropy, router) if with_router else (logp, entropy)


def sequence_positions(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch,
                       per_position: Callable[..., tuple[jax.Array, ...]], inputs: tuple[jax.Array, ...] = (), *,
                       unroll: int | bool = 1, temperature: float = 1.0, with_router: bool = False,
                       replay: bool = False, dropout_key: jax.Array | None = None, index_replay: bool = False,
                       index_loss: str | None = None, adapter_ids: jax.Array | None = None) -> Any:
    """per_position(logits, targets, *inputs) at every position t of batch.tokens, where logits
    / temperature are the decoder's (graphdef, params) for the token after tokens[:t] (float32
    [B, c, V]: the LM head runs `logits_chunk` positions at a time, `chunked_positions`, and
    [B, T, V] never exists), targets tokens[:, t] and inputs[i][:, t] (each [B, T, ...], in the
    batch's layout). Returns its outputs as [B, T, ...] arrays, 0 at t = 0, and with with_router
    (outputs, RouterInfo or None). dropout_key, index_replay, adapter_ids: as `sequence_logits`'.
    index_loss: a DSA model's indexers' KL to the attention ("dense" or "sparse";
    RouterInfo.index_kl; `Backbone.forward`)."""
    model = nnx.merge(graphdef, params)
    (hidden, router), tokens, back = _run(model, batch, unroll, routing=batch.routing,
                                          replay=jnp.asarray(replay), return_routing=True, dropout_key=dropout_key,
                                          indices=batch.indices, replay_indices=jnp.asarray(index_replay),
                                          index_loss=index_loss, head=False, adapter_ids=adapter_ids)
    head = (lambda h: model.logits(h) / temperature) if temperature != 1.0 else model.logits
    if batch.packing is not None:  # the inputs in the packed rows' layout, as the tokens
        inputs = pack_tokens(batch.tokens, batch.positions, batch.attention_mask > 0, batch.pack_row,
                             batch.pack_offset, batch.packing, extra=tuple(inputs), extra_fill=0)[3]
    # packed: a trajectory's first token gets the previous segment's last logits; it is a prompt
    # token (never trained on), and set to 0 as the padded path has it
    T = batch.tokens.shape[1]
    first = lambda x: (jnp.arange(T) == 0).reshape(1, T, *(1,) * (x.ndim - 2))  # noqa: E731
    outs = tuple(jnp.where(first(x), jnp.zeros((), x.dtype), x) for x in map(back, chunked_positions(
        hidden, head, tokens, per_position, inputs, chunk=model.backbone.execution.logits_chunk)))
    return (outs, _with_ids(router, back)) if with_router else outs


def sequence_values(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *,
                    unroll: int | bool = 1, dropout_key: jax.Array | None = None) -> jax.Array:
    """V(tokens[:t]) at each position t: the critic's output on the prefix before token t.
    dropout_key: as `sequence_logits`'."""
    return shift_right(_values(graphdef, params, batch, unroll, dropout_key))


def _values(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, unroll: int | bool = 1,
            dropout_key: jax.Array | None = None) -> jax.Array:
    values, _, back = _run(nnx.merge(graphdef, params), batch, unroll, dropout_key=dropout_key)
    return back(values)


def training_key(step: jax.Array, tokens: jax.Array) -> jax.Array:
    """The key of a training pass's dropout (LoRA's): folded from the step and a hash of the
    (micro-)batch's tokens, so each step and micro-batch draws its own masks, and a resumed run
    draws the same ones with no key in its state."""
    weights = jnp.arange(tokens.size, dtype=jnp.uint32).reshape(tokens.shape) * jnp.uint32(2654435761) + 1
    digest = jnp.sum(tokens.astype(jnp.uint32) * weights, dtype=jnp.uint32)  # wraps mod 2^32
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), step), digest)


def values_and_final(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch) -> tuple[jax.Array, jax.Array]:
    """`sequence_values` [B, T] and the value of each whole row, V(tokens[:n]) with n the row's
    real tokens [B]: where a truncated episode stopped, for bootstrapping."""
    values = _values(graphdef, params, batch)
    last = jnp.maximum(jnp.sum(batch.attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    return shift_right(values), jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


def policy_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: RolloutBatch, *, temperature: float = 1.0,
                    microbatches: int = 1, replay: bool = False, index_replay: bool = False) -> jax.Array:
    """Per-token log-probs under fixed parameters, at softmax(logits / temperature), in
    `microbatches` slices, zero off the response mask: θ_old of PPO and OPD, or a frozen
    reference for the KL term. replay: a MoE model uses the engine's routing (R3); index_replay:
    a DSA model the engine's chosen keys."""
    logp = map_rows(lambda b: sequence_logprobs(graphdef, params, b, temperature=temperature, replay=replay,
                                                index_replay=index_replay)[0], batch, microbatches)
    return jnp.where(batch.response_mask > 0, logp, 0.0)
