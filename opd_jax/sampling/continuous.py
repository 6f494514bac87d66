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
from opd_jax.sampling.choices import choice_shapes, recorded_choices
from opd_jax.sampling.ops import bucket, sample_tokens
from opd_jax.sampling.prefix_cache import (
    PrefillStats,
    Prefix,
    Prefixes,
    PrefixStore,
    cache_with_prefixes,
    prefill_window,
    shared_prompts,
)


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
    routing: dict[str, jax.Array]  # each recorded choice [S, max_new, ...] (`sampling.choices`; -1: none)


def empty_slots(model: Decoder, slots: int, cache_len: int, max_new: int, n_stop: int, kv_dtype: Any) -> Slots:
    config = model.config
    cache = KVCache.empty(config, slots, cache_len, kv_dtype)
    cache = cache.replace(length=jnp.zeros((slots,), jnp.int32))
    ints = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731 (fresh buffers: the slots are donated)
    ones = lambda: jnp.ones((slots,), jnp.float32)  # noqa: E731
    return Slots(cache=cache, logits=jnp.zeros((slots, config.vocab_size), jnp.float32), next_pos=ints(),
                 done=jnp.ones((slots,), bool), step=ints(), stopped=jnp.zeros((slots,), bool),
                 keys=jnp.zeros((slots, 2), jnp.uint32), temperature=ones(), top_k=ints(),
                 top_p=ones(), stop_ids=jnp.full((slots, n_stop), -1, jnp.int32), max_new=ints(),
                 tokens=jnp.zeros((slots, max_new), jnp.int32), logprobs=jnp.zeros((slots, max_new), jnp.float32),
                 routing={name: jnp.full((slots, max_new, *shape), -1, jnp.int32)
                          for name, shape in choice_shapes(config).items()})


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("slots",))
def _admit(graphdef: nnx.GraphDef, state: nnx.State, slots: Slots, where: jax.Array, row_of: jax.Array,
           before: Prefixes, window: jax.Array, window_mask: jax.Array, positions: jax.Array, keys: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, stop_ids: jax.Array, max_new: jax.Array
           ) -> tuple[Slots, dict[str, jax.Array]]:
    """Prefill u unique prompts (left-padded to P columns; only their last window [u, S] is
    computed, what precedes it comes from `before`: stored prefixes, or nothing) and put n
    requests in slots `where` [n] (an index past the last slot: a padding row, dropped), request
    i starting from the prefill of prompt `row_of[i]` (equal prompts share one). Returns the
    slots and the window's recorded choices (`sampling.choices`), per unique prompt."""
    model: Decoder = nnx.merge(graphdef, state)
    n = where.shape[0]
    P = before.length + window.shape[1]
    cache = cache_with_prefixes(model.config, slots.cache.slots, slots.cache.k.dtype, before)
    logits, cache, info = model.decode_choices(window, cache, positions=positions, attention_mask=window_mask)
    routing = recorded_choices(model.config, info, window.shape)

    def put(big, new, axis=0):  # request i's value
        index = (slice(None),) * axis + (where,)
        return big.at[index].set(new.astype(big.dtype), mode="drop")

    def put_prefilled(big, new, axis=0):  # request i's prompt's row of the prefill
        return put(big, jnp.take(new, row_of, axis=axis), axis)

    c = slots.cache
    new_cache = c.replace(k=put_prefilled(c.k, cache.k, 1), v=put_prefilled(c.v, cache.v, 1),
                          valid=put_prefilled(c.valid, cache.valid), length=put(c.length, jnp.full((n,), P, jnp.int32)),
                          k_scale=None if c.k_scale is None else put_prefilled(c.k_scale, cache.k_scale, 1),
                          v_scale=None if c.v_scale is None else put_prefilled(c.v_scale, cache.v_scale, 1))
    slots = slots.replace(
        cache=new_cache, logits=put_prefilled(slots.logits, logits),
        next_pos=put_prefilled(slots.next_pos, positions[:, -1] + 1),
        done=put(slots.done, jnp.zeros((n,), bool)), step=put(slots.step, jnp.zeros((n,), jnp.int32)),
        stopped=put(slots.stopped, jnp.zeros((n,), bool)), keys=put(slots.keys, jax.random.key_data(keys)),
        temperature=put(slots.temperature, temperature), top_k=put(slots.top_k, top_k), top_p=put(slots.top_p, top_p),
        stop_ids=put(slots.stop_ids, stop_ids), max_new=put(slots.max_new, max_new),
        routing={name: put(r, jnp.full((n, *r.shape[1:]), -1)) for name, r in slots.routing.items()})
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
        logits, cache, info = model.decode_choices(token[:, None], s.cache, positions=s.next_pos[:, None],
                                                   attention_mask=live[:, None])
        used = recorded_choices(model.config, info, (rows.shape[0], 1))
        routing = {name: r.at[rows, at].set(jnp.where(live[:, None, None], used[name][:, 0], r[rows, at]))
                   for name, r in s.routing.items()}
        s = s.replace(cache=cache, logits=logits, next_pos=jnp.where(live, s.next_pos + 1, s.next_pos), done=done,
                      step=step, stopped=s.stopped | hit_stop, tokens=tokens, logprobs=logprobs, routing=routing)
        return i + 1, s, ended | jnp.any(live & done)

    return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), slots, jnp.zeros((), bool)))[1]


@jax.jit
def _slot_row(cache: KVCache, slot: jax.Array) -> dict[str, jax.Array | None]:
    """One slot's keys and values [layers, cache_len, ...] (one compiled shape for every slot)."""
    take = lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, slot, axis=1, keepdims=False)  # noqa: E731
    return {"k": take(cache.k), "v": take(cache.v), "k_scale": take(cache.k_scale), "v_scale": take(cache.v_scale)}


def _grow(slots: Slots, *, max_new: int, n_stop: int) -> Slots:
    """The slots with longer output buffers or stop lists (padded: no outputs, no stop ids), so a
    request with a larger budget joins without a restart. The cache keeps its length: a longer
    one would change the rounding of attention for requests already decoding."""
    def pad(x, axis, to, fill=0):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, to - x.shape[axis])
        return jnp.pad(x, widths, constant_values=fill)

    return slots.replace(tokens=pad(slots.tokens, 1, max_new), logprobs=pad(slots.logprobs, 1, max_new),
                         stop_ids=pad(slots.stop_ids, 1, n_stop, -1),
                         routing={name: pad(r, 1, max_new, -1) for name, r in slots.routing.items()})



Result = tuple[np.ndarray, np.ndarray, bool, dict]  # tokens, log-probs, stopped, choices (`sampling.choices`)


class DecodeSlots:
    """Continuous batching on the host: `submit` queues a request (any time, also while others
    decode), `step` admits waiting requests into free slots (in submission order), runs one decode
    chunk and returns the requests that finished, each as (ticket, (tokens, log-probs, stopped at
    a stop id, the recorded choices of prompt + output tokens: `sampling.choices`)). Each slot's cache holds `cache_len`
    tokens (a request needs prompt + max_new_tokens of them); the output buffers and stop lists
    grow (to powers of two) when a request needs more, so the compiled shapes stay few.
    open_queue: requests keep arriving while others decode (an engine serving stream calls as
    they come, e.g. the next turns of episodes). Then a chunk returns as soon as one request
    finishes, so its sender can send the next one, and each request is prefilled alone, padded to
    its own length bucket, so its numbers do not depend on what arrived with it (runs replay
    exactly). Otherwise (every request known up front) a chunk returns early only when a request
    waits for a slot, and requests admitted together share one prefill."""

    def __init__(self, graphdef: nnx.GraphDef, state: nnx.State, *, slots: int, cache_len: int, pad_id: int,
                 kv_dtype: Any = None, chunk: int = 16, max_new: int = 1, n_stop: int = 4, open_queue: bool = False,
                 prefix_store: PrefixStore | None = None, prefill_stats: PrefillStats | None = None):
        self.graphdef, self.state, self.pad_id, self.chunk = graphdef, state, pad_id, chunk
        self.open_queue = open_queue
        model: Decoder = nnx.merge(graphdef, state)
        self.config = model.config
        self.kv_dtype = jnp.dtype(kv_dtype or model.backbone.compute_dtype).name
        self._slots = empty_slots(model, slots, cache_len, bucket(max_new, 1), bucket(n_stop, 4), self.kv_dtype)
        self._waiting: collections.deque = collections.deque()
        self._owner: list[Any] = [None] * slots
        self._prompt_routing: dict[int, dict[str, np.ndarray]] = {}
        # a prefix store: a request that extends a stored sequence prefills only what follows it
        self.prefix_store, self.prefill_stats = prefix_store, prefill_stats or PrefillStats(model.config)
        self._held: dict[int, tuple[list[int], int, Prefix | None]] = {}  # slot -> prompt, its first slot, prefix

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(o is not None for o in self._owner)

    def submit(self, ticket: Any, prompt: Sequence[int], params: Any, key: jax.Array) -> None:
        if len(prompt) + params.max_new_tokens > self._slots.cache.slots:
            raise ValueError(f"a prompt of {len(prompt)} tokens with max_new_tokens={params.max_new_tokens} does not "
                             f"fit a decode slot of {self._slots.cache.slots}")
        self._waiting.append((ticket, list(prompt), params, key))

    def _fit(self, max_new: int, n_stop: int) -> None:
        s = self._slots
        want = max(s.tokens.shape[1], bucket(max_new, 1)), max(s.stop_ids.shape[1], bucket(n_stop, 4))
        if want != (s.tokens.shape[1], s.stop_ids.shape[1]):
            self._slots = _grow(s, max_new=want[0], n_stop=want[1])

    def _admit(self) -> None:
        free = [s for s, o in enumerate(self._owner) if o is None]
        n = min(len(free), len(self._waiting))
        if self.open_queue:
            for _ in range(n):
                self._prefill([self._waiting.popleft()], free[:1])
                free = free[1:]
        elif n:
            self._prefill([self._waiting.popleft() for _ in range(n)], free)

    def _prefill(self, take: list, free: list[int]) -> None:
        width = bucket(len(take), 1)  # a few compiled prefill shapes
        longest, max_new = max(len(p) for _, p, _, _ in take), max(q.max_new_tokens for _, _, q, _ in take)
        # the prefill fills prompt_width cache slots, then each request writes its outputs after them
        prompt_width = max(longest, min(bucket(longest, 16), self._slots.cache.slots - max_new))
        self._fit(max_new, max(len(q.stop_token_ids) for _, _, q, _ in take))
        n_stop = self._slots.stop_ids.shape[1]
        stops = np.full((width, n_stop), -1, np.int32)
        where = np.full(width, len(self._owner), np.int32)  # past the last slot: dropped
        keys = jnp.stack([k for _, _, _, k in take] + [take[0][3]] * (width - len(take)))
        # the samples of a group admitted together prefill their prompt once (padding requests: row 0, dropped)
        row_of, unique = shared_prompts([p for _, p, _, _ in take], share=self.prefix_store is not None)
        row_of = np.pad(row_of, (0, width - len(take)))
        n_rows = bucket(len(unique), 1)
        prompts = unique + [[self.pad_id]] * (n_rows - len(unique))  # padding rows: one token
        prefixes = [self.prefix_store.match(p) if self.prefix_store is not None else None for p in unique]
        prefixes += [None] * (n_rows - len(unique))
        window = prefill_window(self.config, self.kv_dtype, prompts, prefixes, prompt_width, self.pad_id)
        self.prefill_stats.add([len(p) for _, p, _, _ in take], [(max(0, len(p) - window.width), len(p)) for p in unique])
        for j, (ticket, prompt, params, _) in enumerate(take):
            stops[j, :len(params.stop_token_ids)] = params.stop_token_ids
            where[j], self._owner[free[j]] = free[j], ticket
            self._held[free[j]] = prompt, prompt_width - len(prompt), prefixes[row_of[j]]
        field = lambda name, dtype: jnp.asarray([getattr(t[2], name) for t in take]  # noqa: E731
                                                + [getattr(take[0][2], name)] * (width - len(take)), dtype)
        self._slots, routed = _admit(self.graphdef, self.state, self._slots, jnp.asarray(where), jnp.asarray(row_of),
                                     window.before, *window.arrays(), keys, field("temperature", jnp.float32),
                                     field("top_k", jnp.int32), field("top_p", jnp.float32), jnp.asarray(stops),
                                     field("max_new_tokens", jnp.int32))
        routed = jax.device_get(routed)
        for j, (_, prompt, _, _) in enumerate(take):
            self._prompt_routing[free[j]] = window.prompt_routing({k: v[row_of[j]] for k, v in routed.items()},
                                                                  prefixes[row_of[j]], len(prompt))

    def step(self) -> list[tuple[Any, Result]]:
        """Admit what waits into free slots (in the order it came), decode one chunk, return what
        finished."""
        self._admit()
        if not any(o is not None for o in self._owner):
            return []
        self._slots = _decode(self.graphdef, self.state, self._slots, jnp.int32(self.pad_id),
                              jnp.asarray(self.open_queue or bool(self._waiting)), chunk=self.chunk)
        done, step = jax.device_get((self._slots.done, self._slots.step))
        finished = [s for s, o in enumerate(self._owner) if o is not None and done[s]]
        out = []
        if finished:
            s_ = self._slots
            got = jax.device_get((s_.tokens, s_.logprobs, s_.stopped, s_.routing))
            for s in finished:
                n = int(step[s])
                prompt = self._prompt_routing.pop(s)
                choices = {k: np.concatenate([prompt[k], v[s, :n]]) for k, v in got[3].items()}
                out.append((self._owner[s], (got[0][s, :n], got[1][s, :n], bool(got[2][s]), choices)))
                self._keep(s, [int(t) for t in got[0][s, :n]], choices)
                self._owner[s] = None
        return out

    def _keep(self, slot: int, output: list[int], choices: dict[str, np.ndarray]) -> None:
        """Store a finished request's prompt + output KV (its slot's valid span), in place of the
        prefix it extended."""
        prompt, first, extended = self._held.pop(slot)
        if self.prefix_store is None:
            return
        row = jax.device_get(_slot_row(self._slots.cache, jnp.int32(slot)))
        span = slice(first, first + len(prompt) + len(output))
        part = lambda x: None if x is None else np.array(x[:, span])  # noqa: E731 (a copy, in the cache dtype)
        self.prefix_store.add(Prefix(ids=tuple(prompt) + tuple(output), k=part(row["k"]), v=part(row["v"]),
                                     k_scale=part(row["k_scale"]), v_scale=part(row["v_scale"]), routing=choices),
                              extends=extended)


def generate_continuous(graphdef: nnx.GraphDef, state: nnx.State, prompts: Sequence[Sequence[int]],
                        params: Sequence[Any], row_keys: jax.Array, *, slots: int, cache_len: int, pad_id: int,
                        kv_dtype: Any = None, chunk: int = 16, prefix_store: PrefixStore | None = None,
                        prefill_stats: PrefillStats | None = None) -> list[Result]:
    """Every request through `slots` decode slots (`DecodeSlots`), admitted in order as slots free
    up; the results in the order of the requests."""
    decoding = DecodeSlots(graphdef, state, slots=slots, cache_len=cache_len, pad_id=pad_id, kv_dtype=kv_dtype,
                           chunk=chunk, max_new=max(q.max_new_tokens for q in params),
                           n_stop=max(len(q.stop_token_ids) for q in params) or 1, prefix_store=prefix_store,
                           prefill_stats=prefill_stats)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        decoding.submit(i, prompt, p, row_keys[i])
    results: list[Any] = [None] * len(prompts)
    while decoding.busy:
        for i, result in decoding.step():
            results[i] = result
    return results
