"""The embedded JAX rollout engine: batched prefill + decode over a KV cache, in one jitted call.

Prompts are left-padded to a length bucket so every row's next token sits in the same cache
slot; positions count real tokens only, so a padded row computes exactly what it would alone.
Generation is a `lax.while_loop` that stops once every row has finished, compiled once per
(batch bucket, prompt bucket, max_new_tokens, stop-list width) and reused across calls and weight
updates: a batch is padded to a power of two with rows that stop after one token, so multi-turn
episodes, whose live count shrinks turn by turn, do not compile a variant per count.
Each row draws from its own key, fold_in(fold_in(key, row), step), so a request's sample does not
depend on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.errors import OpdJaxError
from opd_jax.models.decoder import Decoder, KVCache
from opd_jax.sampling.choices import as_fields, choice_shapes, of_fields, recorded_choices
from opd_jax.sampling.continuous import DecodeSlots, Result, generate_continuous
from opd_jax.sampling.ops import bucket, sample_tokens
from opd_jax.sampling.prefix_cache import (
    PrefillStats,
    PrefillWindow,
    Prefix,
    Prefixes,
    PrefixStore,
    cache_with_prefixes,
    prefill_window,
    shared_prompts,
)
from rollout_bridge.records import Rollout, SamplingParams


class PromptTooLongError(OpdJaxError, ValueError):
    """A prompt that does not fit the engine's KV cache together with its max_new_tokens."""



@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "slots", "kv_dtype"))
def _generate(graphdef: nnx.GraphDef, state: nnx.State, prefixes: Prefixes, window: jax.Array,
              window_mask: jax.Array, window_positions: jax.Array, row_of: jax.Array, row_keys: jax.Array,
              temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, stop_ids: jax.Array, row_max_new: jax.Array,
              pad_id: jax.Array, *, max_new: int, slots: int, kv_dtype: str):
    """Prefill the prompts' last window columns [U, S] (what precedes them comes from `prefixes`:
    stored KV, or nothing), then decode the B rows, row b a copy of prompt row_of[b] (the samples
    of one prompt share its prefill)."""
    model: Decoder = nnx.merge(graphdef, state)
    cache = cache_with_prefixes(model.config, slots, kv_dtype, prefixes)
    logits, cache, info = model.decode_choices(window, cache, positions=window_positions, attention_mask=window_mask)
    window_routing = recorded_choices(model.config, info, window.shape)
    copy = lambda x: None if x is None else jnp.take(x, row_of, axis=1)  # noqa: E731  ([layers, rows, ...])
    cache = cache.replace(k=copy(cache.k), v=copy(cache.v), k_scale=copy(cache.k_scale), v_scale=copy(cache.v_scale),
                          valid=cache.valid[row_of])
    logits = logits[row_of]
    window_routing = jax.tree.map(lambda x: x[row_of], window_routing)
    B = row_of.shape[0]
    # what every prompt and output token chose (`recorded_choices`: experts, DSA's keys); -1 = none
    routing = {name: jnp.full((B, max_new, *shape), -1, jnp.int32) for name, shape in choice_shapes(model.config).items()}

    def cond(carry):
        step, done = carry[0], carry[3]
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, logits, cache, done, next_pos, tokens, logprobs, lengths, stopped, routing = carry
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
        token, logprob = sample_tokens(logits, keys, temperature, top_k, top_p)
        token = jnp.where(done, pad_id, token)
        tokens = tokens.at[:, step].set(token)
        logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, logprob))
        lengths = jnp.where(done, lengths, step + 1)
        hit_stop = ~done & jnp.any(token[:, None] == stop_ids, axis=1)
        stopped = stopped | hit_stop
        live = ~done
        done = done | hit_stop | (step + 1 >= row_max_new)
        logits, cache, info = model.decode_choices(token[:, None], cache, positions=next_pos[:, None],
                                                   attention_mask=live[:, None])
        used = recorded_choices(model.config, info, (B, 1))
        routing = {name: routing[name].at[:, step].set(jnp.where(live[:, None, None], used[name][:, 0], -1))
                   for name in routing}
        return step + 1, logits, cache, done, next_pos + 1, tokens, logprobs, lengths, stopped, routing

    zeros_b = jnp.zeros((B,), jnp.int32)
    carry = (jnp.zeros((), jnp.int32), logits, cache, jnp.zeros((B,), bool), window_positions[row_of, -1] + 1,
             jnp.full((B, max_new), pad_id, jnp.int32), jnp.zeros((B, max_new), jnp.float32), zeros_b,
             jnp.zeros((B,), bool), routing)
    carry = jax.lax.while_loop(cond, body, carry)
    return carry[5], carry[6], carry[7], carry[8], (window_routing, carry[9]), carry[2]


@dataclasses.dataclass
class _Plan:
    """How one static batch is prefilled (see Sampler._plan)."""

    row_of: np.ndarray  # [B]: each row's prompt among the unique ones
    prompts: list[list[int]]  # [B]
    prefixes: list[Prefix | None]  # per unique prompt: the stored sequence it extends
    window: PrefillWindow

    def routed(self, i: int, routing: Any, length: int) -> dict[str, np.ndarray]:
        """Per recorded choice (`choice_shapes`) [prompt + output tokens, ...]: what each token of
        row i chose (the prompt's: the stored prefix's before the window, the window's after)."""
        window_part, output_part = routing
        prompt = self.window.prompt_routing({k: v[i] for k, v in window_part.items()},
                                            self.prefixes[self.row_of[i]], len(self.prompts[i]))
        return {k: np.concatenate([prompt[k], output_part[k][i, :length]]) for k in output_part}


class Sampler:
    """Generate from a Decoder: token ids in, `Rollout` records (ids, logprobs, finish reason) out.

    max_cache_len bounds prompt + max_new_tokens (default: the model's max_position_embeddings).
    kv_cache_dtype: the KV cache's precision (default: the model's compute dtype; float8_e4m3fn
    with a scale per token and head). slots: decode at most this many requests at once, by
    continuous batching (`sampling.continuous`: a finished request's slot goes to the next one);
    None: every request of a call in one static batch. `update_weights` swaps in new parameters
    of the same shapes without recompiling.
    """

    def __init__(self, model: Decoder, *, max_cache_len: int | None = None, pad_id: int = 0,
                 weight_version: int = 0, kv_cache_dtype: str | None = None, slots: int | None = None,
                 prefix_cache_tokens: int = 0):
        if slots is not None and slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.kv_cache_dtype, self.slots = kv_cache_dtype, slots
        self.cache_dtype = jnp.dtype(kv_cache_dtype or model.backbone.compute_dtype).name
        self.prefix_store = PrefixStore(prefix_cache_tokens) if prefix_cache_tokens else None
        self.prefill_stats = PrefillStats(model.config)
        self.graphdef, self.state = nnx.split(model)
        self.config = model.config
        self.max_cache_len = max_cache_len or model.config.max_position_embeddings
        self.pad_id = pad_id
        self.weight_version = weight_version

    def update_weights(self, model: Decoder, weight_version: int) -> None:
        graphdef, state = nnx.split(model)
        if graphdef != self.graphdef:
            raise ValueError("update_weights needs a model of the same architecture and dtypes")
        self._serve(state, weight_version)

    def update_adapters(self, adapters: dict[str, Any], weight_version: int) -> None:
        """Swap in new LoRA adapters (`nnx.to_pure_dict` of a model's `nnx.LoRAParam` state, in
        this sampler's dtypes) on the base it holds: nothing else is copied. ValueError when this
        sampler's model has no such adapters (other names, shapes or dtypes)."""
        held = nnx.to_pure_dict(nnx.state(nnx.merge(self.graphdef, self.state), nnx.LoRAParam))
        shape = lambda tree: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype).name), tree)  # noqa: E731
        if not held or shape(held) != shape(adapters):
            raise ValueError("update_adapters needs adapters of the names, shapes and dtypes this model holds")
        state = jax.tree.map(lambda x: x, self.state)  # new variables on the same arrays: a decode under way keeps its own
        nnx.replace_by_pure_dict(state, adapters)
        self._serve(state, weight_version)

    def _serve(self, state: nnx.State, weight_version: int) -> None:
        self.state, self.weight_version = state, weight_version
        if self.prefix_store is not None:  # its KV is the old weights'
            self.prefix_store.clear()

    def check(self, prompt: Sequence[int], params: SamplingParams, name: str = "the prompt") -> None:
        """ValueError (PromptTooLongError) for a prompt this engine cannot run."""
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty")
        if len(prompt) + params.max_new_tokens > self.max_cache_len:
            raise PromptTooLongError(
                f"{name} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} it needs "
                f"{len(prompt) + params.max_new_tokens} cache slots, but the cache holds {self.max_cache_len}")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {self.config.vocab_size})")

    def decode_slots(self) -> DecodeSlots:
        """Continuous batching across calls (`sampling.continuous.DecodeSlots`): `slots` decode
        slots of max_cache_len tokens each, with the current weights, for requests that arrive
        while others decode (`open_queue`). Build a new one after `update_weights`."""
        if self.slots is None:
            raise ValueError("decode_slots needs a Sampler built with slots=")
        return DecodeSlots(self.graphdef, self.state, slots=self.slots, cache_len=self.max_cache_len,
                           pad_id=self.pad_id, kv_dtype=self.kv_cache_dtype, open_queue=True,
                           prefix_store=self.prefix_store, prefill_stats=self.prefill_stats)

    def rollout(self, prompt: Sequence[int], result: Result, metadata: dict[str, Any] | None = None) -> Rollout:
        """The Rollout of a continuous-batching result (tokens, log-probs, stopped, choices)."""
        ids, logp, stopped, choices = result
        return Rollout(prompt_ids=tuple(int(t) for t in prompt), output_ids=tuple(int(t) for t in ids),
                       output_logprobs=tuple(float(x) for x in logp), finish_reason="stop" if stopped else "length",
                       weight_version=self.weight_version, metadata=dict(metadata or {}), **as_fields(choices))

    def compiled_variants(self) -> int:
        """How many shapes the generation function has been compiled for (all Samplers)."""
        return _generate._cache_size()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 key: jax.Array, metadata: Sequence[dict[str, Any]] | None = None) -> list[Rollout]:
        """One rollout per prompt, in order. `params` is shared or one per prompt; `key` is one
        PRNG key (row i draws from fold_in(key, i)) or one key per prompt. Prompts that are equal
        are prefilled once; with a prefix store, a prompt that extends a stored sequence prefills
        only what follows it."""
        if not prompts:
            return []
        per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_row) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_row)} SamplingParams")
        max_new = max(p.max_new_tokens for p in per_row)
        longest = max(len(p) for p in prompts)
        for i, (prompt, p) in enumerate(zip(prompts, per_row)):
            self.check(prompt, p, f"prompt {i}")
        width = max(longest, min(bucket(longest, 16), self.max_cache_len - max_new))
        B = len(prompts)
        if key.shape == (B,):
            row_keys = key
        elif key.shape == ():
            row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(B))
        else:
            raise ValueError(f"key must be one PRNG key or one per prompt ({B}), got shape {key.shape}")
        metadata = metadata or [{} for _ in prompts]
        if self.slots is not None and self.slots < B:
            done = generate_continuous(self.graphdef, self.state, prompts, per_row, row_keys, slots=self.slots,
                                       cache_len=width + max_new, pad_id=self.pad_id, kv_dtype=self.kv_cache_dtype,
                                       prefix_store=self.prefix_store, prefill_stats=self.prefill_stats)
            return [self.rollout(prompts[i], result, metadata[i]) for i, result in enumerate(done)]
        plan = self._plan(prompts, width, max_new)
        # padding rows: copies of row 0 that stop after one token, dropped below
        rows = bucket(B, minimum=1)
        pad = np.zeros(rows - B, np.int32)
        padded = per_row + [dataclasses.replace(per_row[0], max_new_tokens=1)] * (rows - B)
        n_stop = bucket(max(len(p.stop_token_ids) for p in per_row) or 1, minimum=4)
        stop_ids = np.full((rows, n_stop), -1, np.int32)
        for i, p in enumerate(padded):
            stop_ids[i, :len(p.stop_token_ids)] = p.stop_token_ids
        *out, cache = _generate(
            self.graphdef, self.state, plan.window.before, *plan.window.arrays(),
            jnp.asarray(np.concatenate([plan.row_of, pad])), jnp.concatenate([row_keys, row_keys[pad]]),
            jnp.asarray([p.temperature for p in padded], jnp.float32),
            jnp.asarray([p.top_k for p in padded], jnp.int32),
            jnp.asarray([p.top_p for p in padded], jnp.float32), jnp.asarray(stop_ids),
            jnp.asarray([p.max_new_tokens for p in padded], jnp.int32), jnp.int32(self.pad_id), max_new=max_new,
            slots=width + max_new, kv_dtype=self.cache_dtype)
        out_tokens, out_logprobs, lengths, stopped, routing = jax.device_get(out)
        rollouts = [Rollout(prompt_ids=tuple(int(t) for t in prompts[i]),
                            output_ids=tuple(int(t) for t in out_tokens[i, :lengths[i]]),
                            output_logprobs=tuple(float(x) for x in out_logprobs[i, :lengths[i]]),
                            finish_reason="stop" if stopped[i] else "length", weight_version=self.weight_version,
                            metadata=dict(metadata[i]), **as_fields(plan.routed(i, routing, lengths[i])))
                    for i in range(B)]
        if self.prefix_store is not None:
            self._keep(rollouts, cache, width, plan)
        return rollouts

    def _plan(self, prompts: Sequence[Sequence[int]], width: int, max_new: int) -> _Plan:
        """The unique prompts (padded to a bucket of rows with copies of the first), each one's
        stored prefix, and what is left to prefill: the window of prompt columns after it."""
        row_of, real = shared_prompts(prompts, share=self.prefix_store is not None)
        rows = bucket(len(real), minimum=1)  # never more than the batch's own bucket
        prefixes = [self.prefix_store.match(p) if self.prefix_store is not None else None for p in real]
        # padding rows copy the first prompt and its stored prefix, so they widen no window
        padded, prefixes = real + [real[0]] * (rows - len(real)), prefixes + prefixes[:1] * (rows - len(real))
        window = prefill_window(self.config, self.cache_dtype, padded, prefixes, width, self.pad_id)
        self.prefill_stats.add([len(p) for p in prompts], [(max(0, len(p) - window.width), len(p)) for p in real])
        return _Plan(row_of=row_of, prompts=[list(p) for p in prompts], prefixes=prefixes, window=window)

    def _keep(self, rollouts: list[Rollout], cache: KVCache, width: int, plan: _Plan) -> None:
        """Store each row's prompt + output KV (its valid slots), in place of the prefix it extended."""
        host = jax.device_get({"k": cache.k, "v": cache.v, "k_scale": cache.k_scale, "v_scale": cache.v_scale})
        for i, rollout in enumerate(rollouts):
            a, b = width - len(rollout.prompt_ids), width + len(rollout.output_ids)
            part = lambda x: None if x is None else np.array(x[:, i, a:b])  # noqa: E731 (a copy, in the cache dtype)
            self.prefix_store.add(Prefix(ids=rollout.prompt_ids + rollout.output_ids, k=part(host["k"]),
                                         v=part(host["v"]), k_scale=part(host["k_scale"]),
                                         v_scale=part(host["v_scale"]), routing=of_fields(rollout)),
                                  extends=plan.prefixes[plan.row_of[i]])
