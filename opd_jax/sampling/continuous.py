"""Continuous batching for the embedded engine: a fixed number of decode slots, each holding one
request with a KV cache row of its own (written at its own position, `KVCache.length` [slots]).
A finished request leaves its slot at the end of a decode chunk and a waiting one is prefilled
into it, so a long straggler holds one slot instead of the whole batch.

Each request draws its t-th token from fold_in(its key, t), as `Sampler.generate` does, so its
tokens and log-probs are those it gets when run alone with the same key (up to float rounding
of attention over a differently sized cache). Compiled once per (slots, cache length, output
budget, stop-list width) for the decode chunk, and per prompt bucket for the prefill.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.models.decoder import Decoder, KVCache
from opd_jax.sampling.ops import sample_tokens


@flax.struct.dataclass
class Slots:
    """The decode state of every slot: its cache row, the logits of its next token, where that
    token goes, its sampling parameters, and what it has generated (tokens, log-probs, experts)."""

    cache: KVCache
    logits: jax.Array  # [S, V]
    next_pos: jax.Array  # [S]
    done: jax.Array  # [S] bool: finished, or free
    step: jax.Array  # [S] tokens generated
    stopped: jax.Array  # [S] bool: ended at a stop id
    keys: jax.Array  # [S, 2] uint32: each slot's PRNG key data
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop_ids: jax.Array  # [S, n_stop], -1 padded
    max_new: jax.Array  # [S]
    tokens: jax.Array  # [S, max_new]
    logprobs: jax.Array  # [S, max_new]
    routing: jax.Array | None  # [S, max_new, MoE layers, k] (-1: none); None for a dense model


def empty_slots(model: Decoder, slots: int, cache_len: int, max_new: int, n_stop: int, kv_dtype: Any) -> Slots:
    config = model.config
    cache = KVCache.empty(config, slots, cache_len, kv_dtype)
    cache = cache.replace(length=jnp.zeros((slots,), jnp.int32))
    moe = config.moe
    ints = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731 (fresh buffers: the slots are donated)
    ones = lambda: jnp.ones((slots,), jnp.float32)  # noqa: E731
    return Slots(cache=cache, logits=jnp.zeros((slots, config.vocab_size), jnp.float32), next_pos=ints(),
                 done=jnp.ones((slots,), bool), step=ints(), stopped=jnp.zeros((slots,), bool),
                 keys=jnp.zeros((slots, 2), jnp.uint32), temperature=ones(), top_k=ints(),
                 top_p=ones(), stop_ids=jnp.full((slots, n_stop), -1, jnp.int32), max_new=ints(),
                 tokens=jnp.zeros((slots, max_new), jnp.int32), logprobs=jnp.zeros((slots, max_new), jnp.float32),
                 routing=None if moe is None else jnp.full((slots, max_new, len(config.moe_layers),
                                                            moe.experts_per_token), -1, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("slots",))
def _admit(graphdef: nnx.GraphDef, state: nnx.State, slots: Slots, where: jax.Array, prompt: jax.Array,
           prompt_mask: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           stop_ids: jax.Array, max_new: jax.Array) -> tuple[Slots, jax.Array | None]:
    """Prefill n new prompts (left-padded [n, P]) and put them in slots `where` [n] (an index past
    the last slot: a padding row, dropped). Returns the slots and the prompts' experts (MoE)."""
    model: Decoder = nnx.merge(graphdef, state)
    n, P = prompt.shape
    cache = KVCache.empty(model.config, n, slots.cache.slots, slots.cache.k.dtype)
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)
    logits, cache, routing = model.decode(prompt, cache, positions=positions, attention_mask=prompt_mask,
                                          return_routing=True)

    def put(big, new, axis=0):
        index = (slice(None),) * axis + (where,)
        return big.at[index].set(new.astype(big.dtype), mode="drop")

    c = slots.cache
    new_cache = c.replace(k=put(c.k, cache.k, 1), v=put(c.v, cache.v, 1), valid=put(c.valid, cache.valid),
                          length=put(c.length, jnp.full((n,), P, jnp.int32)),
                          k_scale=None if c.k_scale is None else put(c.k_scale, cache.k_scale, 1),
                          v_scale=None if c.v_scale is None else put(c.v_scale, cache.v_scale, 1))
    slots = slots.replace(
        cache=new_cache, logits=put(slots.logits, logits), next_pos=put(slots.next_pos, positions[:, -1] + 1),
        done=put(slots.done, jnp.zeros((n,), bool)), step=put(slots.step, jnp.zeros((n,), jnp.int32)),
        stopped=put(slots.stopped, jnp.zeros((n,), bool)), keys=put(slots.keys, jax.random.key_data(keys)),
        temperature=put(slots.temperature, temperature), top_k=put(slots.top_k, top_k), top_p=put(slots.top_p, top_p),
        stop_ids=put(slots.stop_ids, stop_ids), max_new=put(slots.max_new, max_new),
        routing=None if slots.routing is None else put(slots.routing, jnp.full((n, *slots.routing.shape[1:]), -1)))
    return slots, routing


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"), donate_argnames=("slots",))
def _decode(graphdef: nnx.GraphDef, state: nnx.State, slots: Slots, pad_id: jax.Array, until_one_ends: jax.Array,
            *, chunk: int) -> Slots:
    """Up to `chunk` decode steps of every live slot; stops early when every slot is done, or
    (until_one_ends) as soon as one finishes, so a waiting request can take its place."""
    model: Decoder = nnx.merge(graphdef, state)
    rows = jnp.arange(slots.done.shape[0])
    max_new = slots.tokens.shape[1]

    def cond(carry):
        i, s, ended = carry
        return (i < chunk) & ~jnp.all(s.done) & ~(until_one_ends & ended)

    def body(carry):
        i, s, ended = carry
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(s.keys), s.step)
        token, logprob = sample_tokens(s.logits, keys, s.temperature, s.top_k, s.top_p)
        live = ~s.done
        token = jnp.where(live, token, pad_id)
        at = jnp.minimum(s.step, max_new - 1)
        tokens = s.tokens.at[rows, at].set(jnp.where(live, token, s.tokens[rows, at]))
        logprobs = s.logprobs.at[rows, at].set(jnp.where(live, logprob, s.logprobs[rows, at]))
        hit_stop = live & jnp.any(token[:, None] == s.stop_ids, axis=1)
        step = jnp.where(live, s.step + 1, s.step)
        done = s.done | hit_stop | (live & (step >= s.max_new))
        logits, cache, used = model.decode(token[:, None], s.cache, positions=s.next_pos[:, None],
                                           attention_mask=live[:, None], return_routing=True)
        routing = s.routing
        if routing is not None:
            routing = routing.at[rows, at].set(jnp.where(live[:, None, None], used[:, 0], routing[rows, at]))
        s = s.replace(cache=cache, logits=logits, next_pos=jnp.where(live, s.next_pos + 1, s.next_pos), done=done,
                      step=step, stopped=s.stopped | hit_stop, tokens=tokens, logprobs=logprobs, routing=routing)
        return i + 1, s, ended | jnp.any(live & done)

    return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), slots, jnp.zeros((), bool)))[1]


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def generate_continuous(graphdef: nnx.GraphDef, state: nnx.State, prompts: Sequence[Sequence[int]],
                        params: Sequence[Any], row_keys: jax.Array, *, slots: int, cache_len: int, prompt_width: int,
                        pad_id: int, kv_dtype: Any = None, chunk: int = 16) -> list[tuple[np.ndarray, np.ndarray, bool,
                                                                                  np.ndarray | None]]:
    """Every request through `slots` decode slots, admitted in order as slots free up. Returns per
    request (tokens, log-probs, stopped at a stop id, experts of prompt + output tokens or None).
    prompt_width: the left-padded width of every prefill (≥ the longest prompt)."""
    model: Decoder = nnx.merge(graphdef, state)
    n = len(prompts)
    max_new = max(p.max_new_tokens for p in params)
    n_stop = _bucket(max(len(p.stop_token_ids) for p in params) or 1, minimum=4)
    slot_state = empty_slots(model, slots, cache_len, max_new, n_stop, kv_dtype or model.backbone.compute_dtype)
    waiting = collections.deque(range(n))
    owner: list[int | None] = [None] * slots
    prompt_routing: dict[int, np.ndarray] = {}
    results: list[Any] = [None] * n
    while waiting or any(o is not None for o in owner):
        free = [s for s in range(slots) if owner[s] is None]
        if free and waiting:
            take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
            width = _bucket(len(take))  # a few compiled prefill shapes
            tokens = np.full((width, prompt_width), pad_id, np.int32)
            mask = np.zeros((width, prompt_width), bool)
            stops = np.full((width, n_stop), -1, np.int32)
            where = np.full(width, slots, np.int32)  # past the last slot: dropped
            keys = jnp.concatenate([row_keys[np.asarray(take)], row_keys[np.zeros(width - len(take), int)]])
            for j, r in enumerate(take):
                tokens[j, prompt_width - len(prompts[r]):] = prompts[r]
                mask[j, prompt_width - len(prompts[r]):] = True
                stops[j, :len(params[r].stop_token_ids)] = params[r].stop_token_ids
                where[j], owner[free[j]] = free[j], r
            mask[len(take):, -1] = True  # padding rows: one real token, so nothing is fully masked
            field = lambda name, dtype: jnp.asarray([getattr(params[r], name) for r in take]  # noqa: E731
                                                    + [getattr(params[take[0]], name)] * (width - len(take)), dtype)
            slot_state, routed = _admit(graphdef, state, slot_state, jnp.asarray(where), jnp.asarray(tokens),
                                        jnp.asarray(mask), keys, field("temperature", jnp.float32),
                                        field("top_k", jnp.int32), field("top_p", jnp.float32), jnp.asarray(stops),
                                        field("max_new_tokens", jnp.int32))
            if routed is not None:
                routed = np.asarray(routed)
                for j, r in enumerate(take):
                    prompt_routing[r] = routed[j, prompt_width - len(prompts[r]):]
        slot_state = _decode(graphdef, state, slot_state, jnp.int32(pad_id), jnp.asarray(bool(waiting)), chunk=chunk)
        done, step = jax.device_get((slot_state.done, slot_state.step))
        finished = [s for s in range(slots) if owner[s] is not None and done[s]]
        if finished:
            got = jax.device_get((slot_state.tokens, slot_state.logprobs, slot_state.stopped, slot_state.routing))
            for s in finished:
                r, length = owner[s], int(step[s])
                experts = None if got[3] is None else np.concatenate([prompt_routing.pop(r), got[3][s, :length]])
                results[r] = (got[0][s, :length], got[1][s, :length], bool(got[2][s]), experts)
                owner[s] = None
    return results
